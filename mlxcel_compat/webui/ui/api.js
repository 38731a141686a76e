// The server's HTTP API as the page uses it: JSON GETs and one streaming chat call.
// Every URL is relative to the page, so the page works under --api-prefix too.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message || body?.message || message; // POST /tools: a bare {code, message, type}
  } catch { /* not JSON */ }
  return new ApiError(response.status, message);
}

// SSE "data:" payloads out of a byte stream; comments (keep-alives) are skipped.
export async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

export class Api {
  constructor(base, getKey) {
    this.base = base;
    this.getKey = getKey;
  }

  headers(json = false) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = this.getKey();
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // A raw fetch of a path of this server, with the API key; the caller reads the response.
  fetch(path, init = {}) {
    return fetch(new URL(path, this.base), { ...init, headers: { ...this.headers(), ...(init.headers || {}) } });
  }

  async get(path) {
    const response = await fetch(new URL(path, this.base), { headers: this.headers() });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  async post(path, body) {
    const response = await fetch(new URL(path, this.base), { method: "POST", headers: this.headers(true), body: JSON.stringify(body) });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  // Yields each chat chunk; the last chunks carry usage and timings. With a conversation id the
  // stream is resumable: the server finishes the answer even if this page goes away, and
  // replayStream reads it again (X-Conversation-Id, llama-server's resumable streams).
  async *streamChat(body, signal, conversationId) {
    const headers = this.headers(true);
    if (conversationId) headers["X-Conversation-Id"] = conversationId;
    const response = await fetch(new URL("v1/chat/completions", this.base), {
      method: "POST",
      headers,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      signal,
    });
    if (!response.ok) throw await errorOf(response);
    yield* chatChunks(response);
  }

  // A conversation's resumable stream from its first byte (the whole answer so far, then live).
  async *replayStream(conversationId, signal) {
    const response = await fetch(new URL(`v1/stream?conv_id=${encodeURIComponent(conversationId)}&from=0`, this.base),
      { headers: this.headers(), signal });
    if (!response.ok) throw await errorOf(response);
    yield* chatChunks(response);
  }

  // Whether the server still holds the conversation's stream (it answers only for the ids asked).
  async hasStream(conversationId) {
    const found = await this.post("v1/streams/lookup", { conversation_ids: [conversationId] });
    return found.some((s) => s.conversation_id === conversationId);
  }

  // Stop the conversation's generation on the server (closing the connection no longer does).
  stopStream(conversationId) {
    return this.fetch(`v1/stream?conv_id=${encodeURIComponent(conversationId)}`, { method: "DELETE" }).catch(() => {});
  }
}

async function* chatChunks(response) {
  for await (const data of sseEvents(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
    yield chunk;
  }
}
