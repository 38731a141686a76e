// One conversation on screen: its messages, streaming an answer into it, stop, edit and
// regenerate, and the per-answer figures (tokens/s, prompt tokens, how many came from the cache).
// With the server's tools on, an answer that calls tools runs them and the model answers again
// (tools.js), each call and each result shown as messages of their own.

import { renderMarkdown } from "./render.js";
import { saveConversation } from "./store.js";
import { MAX_ROUNDS, mergeToolCalls, parseArguments } from "./tools.js";

// The figures line under an answer. `stats` comes from the stream's usage and timings.
export function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completion !== undefined) parts.push(`${stats.completion} tokens`);
  if (stats.tps) parts.push(`${stats.tps.toFixed(1)} tokens/s`);
  if (stats.prompt !== undefined) parts.push(`${stats.cached || 0} of ${stats.prompt} prompt tokens from cache${cacheReason(stats.cache)}`);
  if (stats.nCtx && stats.prompt !== undefined) parts.push(`context ${stats.prompt + (stats.completion || 0)}/${stats.nCtx}`);
  if (stats.stopped) parts.push("stopped");
  if (stats.note) parts.push(stats.note);
  return parts.join(" · ");
}

// Why the prompt cache reused what it did (the server's cache_explain): "(hit)", "(miss: template changed)".
function cacheReason(explained) {
  if (!explained?.reason) return "";
  if (explained.reason === "hit") return " (hit)";
  return ` (${explained.outcome === "partial_hit" ? "partly" : "miss"}: ${explained.reason.replaceAll("_", " ")})`;
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function button(label, action) {
  const b = element("button", "", label);
  b.type = "button";
  b.dataset.action = action;
  return b;
}

export class ChatView {
  constructor({ root, api, settings, onChange, onBusy, tools, toolsOn, model }) {
    this.root = root;
    this.model = model || (() => ""); // () => the model the request names (a router's pick), "" for none
    this.api = api;
    this.tools = tools; // Tools (tools.js)
    this.toolsOn = toolsOn || (() => false); // () => whether to offer the tools to the model
    this.settings = settings; // () => Settings
    this.onChange = onChange; // the conversation list changed (title, order)
    this.onBusy = onBusy; // (busy: boolean)
    this.conversation = null;
    this.abort = null;
    this.nCtx = 0;
    root.addEventListener("click", (event) => this.clicked(event));
  }

  get busy() {
    return this.abort !== null;
  }

  show(conversation) {
    this.conversation = conversation;
    this.root.replaceChildren();
    if (!conversation || conversation.messages.length === 0) {
      this.root.append(element("p", "hint", "Ask anything. Conversations are kept in this browser only."));
      return;
    }
    conversation.messages.forEach((message, i) => this.root.append(this.messageElement(message, i)));
    this.scroll(true);
    const last = conversation.messages[conversation.messages.length - 1];
    if (!this.busy && last.role === "assistant" && last.streaming) this.resume(conversation, last);
  }

  messageElement(message, index) {
    const article = element("article", `msg ${message.role}`);
    article.dataset.index = index;
    if (message.role === "tool") {
      article.append(element("div", "role", `Tool result: ${this.tools?.displayName(message.name) || message.name}`));
      article.append(element("pre", "content tool-result", message.content));
      return article;
    }
    article.append(element("div", "role", message.role === "user" ? "You" : "Model"));
    if (message.role === "assistant") {
      const details = element("details", "reasoning");
      details.append(element("summary", "", "Reasoning"), element("div", "reasoning-body markdown"));
      details.hidden = !message.reasoning;
      article.append(details, element("div", "content markdown"), element("ul", "tool-calls"), element("div", "stats"));
      this.fill(article, message);
      article.append(this.actions(button("Regenerate", "regenerate")));
    } else {
      article.append(element("div", "content plain", message.content));
      article.append(this.actions(button("Edit", "edit")));
    }
    return article;
  }

  actions(...buttons) {
    const bar = element("div", "actions");
    bar.append(...buttons);
    return bar;
  }

  // Update an assistant message's element from its record.
  fill(article, message) {
    const details = article.querySelector(".reasoning");
    if (message.reasoning) {
      details.hidden = false;
      details.querySelector("summary").textContent = message.thinking ? "Reasoning (thinking…)" : "Reasoning";
      renderMarkdown(details.querySelector(".reasoning-body"), message.reasoning);
    }
    renderMarkdown(article.querySelector(".content"), message.content);
    const calls = article.querySelector(".tool-calls");
    const unrun = message.unrun_calls ? " (not run)" : "";
    calls.replaceChildren(...(message.tool_calls || message.unrun_calls || []).map((call) =>
      element("li", "", `Calls ${this.tools?.displayName(call.function.name) || call.function.name} (${call.function.name}) with ${call.function.arguments || "{}"}${unrun}`)));
    const stats = article.querySelector(".stats");
    stats.textContent = message.error ? `Error: ${message.error}` : statsText(message.stats);
    stats.classList.toggle("error", Boolean(message.error));
  }

  scroll(force = false) {
    const r = this.root;
    if (force || r.scrollHeight - r.scrollTop - r.clientHeight < 120) r.scrollTop = r.scrollHeight;
  }

  async send(text) {
    if (this.busy || !text.trim()) return;
    const c = this.conversation;
    if (c.messages.length === 0 && c.title === "New chat") c.title = text.trim().slice(0, 48);
    c.messages.push({ role: "user", content: text });
    await this.generate();
  }

  stop() {
    if (!this.abort) return;
    this.abort.abort();
    if (this.conversation) this.api.stopStream(this.conversation.id); // the server would finish it otherwise
  }

  clicked(event) {
    const b = event.target.closest("button[data-action]");
    if (!b || this.busy) return;
    const index = Number(b.closest("article").dataset.index);
    if (b.dataset.action === "regenerate") {
      this.conversation.messages.splice(index);
      this.show(this.conversation);
      this.generate();
    } else if (b.dataset.action === "edit") {
      this.edit(b.closest("article"), index);
    } else if (b.dataset.action === "save-edit") {
      const text = b.closest("article").querySelector("textarea").value;
      if (!text.trim()) return;
      this.conversation.messages.splice(index);
      this.conversation.messages.push({ role: "user", content: text });
      this.show(this.conversation);
      this.generate();
    } else if (b.dataset.action === "cancel-edit") {
      this.show(this.conversation);
    }
  }

  edit(article, index) {
    const content = article.querySelector(".content");
    const area = element("textarea", "edit");
    area.value = this.conversation.messages[index].content;
    area.rows = Math.min(12, area.value.split("\n").length + 1);
    content.replaceWith(area);
    article.querySelector(".actions").replaceWith(this.actions(button("Save and regenerate", "save-edit"), button("Cancel", "cancel-edit")));
    area.focus();
  }

  requestMessages() {
    const system = this.settings().systemMessage;
    const history = this.conversation.messages.map(({ role, content, tool_calls, tool_call_id }) => {
      const m = { role, content };
      if (tool_calls?.length) m.tool_calls = tool_calls;
      if (tool_call_id !== undefined) m.tool_call_id = tool_call_id;
      return m;
    });
    return system ? [{ role: "system", content: system }, ...history] : history;
  }

  // One answer, and while it calls tools: run them, then the next answer (MAX_ROUNDS at most).
  async generate() {
    const c = this.conversation;
    this.abort = new AbortController();
    this.onBusy(true);
    try {
      for (let round = 0; ; round++) {
        const answer = await this.streamAnswer(c);
        if (!answer.tool_calls?.length || answer.error || this.abort.signal.aborted) break;
        if (!answer.tool_calls.every((call) => parseArguments(call) !== undefined)) {
          // A call cut off at max_tokens (or otherwise not JSON) cannot run, and a history holding it is
          // refused with a 400, as llama-server refuses it: it stays on the page, out of the history.
          answer.unrun_calls = answer.tool_calls;
          delete answer.tool_calls;
          answer.stats = { ...(answer.stats || {}), note: "tool calls not run: their arguments are not complete JSON" };
          break;
        }
        if (round >= MAX_ROUNDS) {
          answer.stats = { ...(answer.stats || {}), note: `tool calls not run: ${MAX_ROUNDS} rounds per answer at most` };
          break;
        }
        for (const call of answer.tool_calls) {
          const content = await this.tools.run(call);
          c.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content });
          saveConversation(c);
          if (this.conversation === c) this.show(c);
        }
        if (this.abort.signal.aborted) break;
      }
    } finally {
      this.abort = null;
      this.onBusy(false);
      saveConversation(c);
      this.onChange();
    }
  }

  async streamAnswer(c) {
    const offer = this.toolsOn() && this.tools?.available ? { tools: this.tools.definitions() } : {};
    // cache_explain: the figures line says why the prompt cache reused what it did.
    const picked = this.model() ? { model: this.model() } : {};
    const body = { ...picked, messages: this.requestMessages(), ...offer, cache_explain: true, ...this.settings().requestFields() };
    const answer = { role: "assistant", content: "", reasoning: "", streaming: true };
    c.messages.push(answer);
    saveConversation(c);
    this.onChange();
    this.show(c);
    await this.follow(c, answer, this.api.streamChat(body, this.abort.signal, c.id));
    return answer;
  }

  // An answer that was still being written when the page went away (a reload): the server kept
  // generating it (a resumable stream), so read it again from its first byte and follow it live.
  async resume(c, answer) {
    this.abort = new AbortController();
    this.onBusy(true);
    try {
      if (await this.api.hasStream(c.id)) {
        Object.assign(answer, { content: "", reasoning: "" });
        delete answer.tool_calls;
        await this.follow(c, answer, this.api.replayStream(c.id, this.abort.signal));
      } else {
        delete answer.streaming;
        answer.error = "the answer was interrupted and the server no longer holds it";
        if (this.conversation === c) this.fill(this.root.lastElementChild, answer);
      }
    } catch (error) {
      delete answer.streaming;
      answer.error = error.message;
    } finally {
      this.abort = null;
      this.onBusy(false);
      saveConversation(c);
      this.onChange();
    }
  }

  // Read an answer's chunks into it, painting once an animation frame.
  async follow(c, answer, chunks) {
    const article = this.root.lastElementChild;
    let pending = false;
    const repaint = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; if (this.conversation === c) { this.fill(article, answer); this.scroll(); } });
    };
    try {
      for await (const chunk of chunks) {
        const delta = chunk.choices?.[0]?.delta || {};
        if (delta.reasoning_content) { answer.reasoning += delta.reasoning_content; answer.thinking = true; }
        if (delta.content) { answer.content += delta.content; answer.thinking = false; }
        if (delta.tool_calls) answer.tool_calls = mergeToolCalls(answer.tool_calls || [], delta.tool_calls);
        if (chunk.usage) answer.stats = this.stats(chunk);
        repaint();
      }
    } catch (error) {
      if (this.abort.signal.aborted) answer.stats = { ...(answer.stats || {}), stopped: true };
      else answer.error = error.message;
    } finally {
      answer.thinking = false;
      delete answer.streaming;
      saveConversation(c);
      if (this.conversation === c) { this.fill(article, answer); this.scroll(); }
    }
  }

  stats(chunk) {
    const usage = chunk.usage;
    return {
      prompt: usage.prompt_tokens,
      cached: usage.prompt_tokens_details?.cached_tokens ?? chunk.timings?.cache_n ?? 0,
      completion: usage.completion_tokens,
      tps: chunk.timings?.predicted_per_second,
      nCtx: this.nCtx,
      cache: chunk.cache_explain ? { outcome: chunk.cache_explain.outcome, reason: chunk.cache_explain.reason } : undefined,
    };
  }
}
