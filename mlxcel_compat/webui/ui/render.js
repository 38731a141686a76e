// Model output to DOM, safely: markdown through marked, raw HTML in it shown as text, and the
// result sanitized by DOMPurify before it touches the page. Two layers on purpose: the markdown
// renderer never emits the model's own tags, and DOMPurify drops anything executable that slips
// through (event handlers, javascript: URLs, <script>). The page's CSP allows no inline script.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

const markdown = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    // A model that writes <img onerror=...> or <script> gets those characters on screen.
    html({ text }) {
      return escapeHtml(text);
    },
    // No remote fetches from model output (offline page, no tracking pixels): images become links.
    image({ href, text }) {
      return `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`;
    },
    code({ text, lang }) {
      const language = (lang || "").match(/^[\w+-]*/)[0];
      const label = language ? `<span class="lang">${escapeHtml(language)}</span>` : "";
      return `<div class="code">${label}<button type="button" class="copy" data-copy>Copy</button>` +
        `<pre><code${language ? ` class="language-${escapeHtml(language)}"` : ""}>${escapeHtml(text)}</code></pre></div>`;
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = { USE_PROFILES: { html: true }, FORBID_TAGS: ["style", "form", "input", "img", "svg", "math"], FORBID_ATTR: ["style"] };

// Markdown text to a sanitized HTML string.
export function markdownToHtml(text) {
  return DOMPurify.sanitize(markdown.parse(text || ""), PURIFY);
}

// Render markdown into an element, replacing its content.
export function renderMarkdown(element, text) {
  element.innerHTML = markdownToHtml(text);
}

// Copy buttons of code blocks: one delegated listener, no inline handlers.
export function enableCopyButtons(root) {
  root.addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const code = button.parentElement.querySelector("code");
    navigator.clipboard?.writeText(code.textContent).then(
      () => { button.textContent = "Copied"; },
      () => { button.textContent = "Copy failed"; },
    );
  });
}
