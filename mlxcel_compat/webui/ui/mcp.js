// MCP servers the page talks to itself (Settings: one URL per line), through the server's CORS
// proxy (--ui-mcp-proxy): a browser page cannot reach another origin that sends no CORS headers,
// so each JSON-RPC message goes to /cors-proxy?url=..., its headers as the proxy's
// X-Llama-Server-Proxy-Header-* names. MCP's streamable HTTP transport: POST one message, the
// answer is JSON or an SSE stream; the server's Mcp-Session-Id comes back and goes with every
// later message. Their tools are offered to the model beside the server's built-in ones.

import { sseEvents } from "./api.js";

const PROTOCOL_VERSION = "2024-11-05";
const PROXY_HEADER = "X-Llama-Server-Proxy-Header-";

export class McpClient {
  constructor(api) {
    this.api = api;
    this.nextId = 1;
  }

  // {url, session, tools: [{name, description, inputSchema}]}; throws when the server cannot be used.
  async connect(url) {
    const server = { url, session: "", tools: [] };
    await this.rpc(server, "initialize", { protocolVersion: PROTOCOL_VERSION, capabilities: {}, clientInfo: { name: "mlxcel-server chat page", version: "1.0" } });
    await this.rpc(server, "notifications/initialized", undefined, true);
    const listed = await this.rpc(server, "tools/list", {});
    server.tools = (listed?.tools || []).filter((t) => t && typeof t.name === "string");
    return server;
  }

  // A tools/call result as the model reads it: the text parts, as llama-server joins them.
  async call(server, name, args) {
    const result = await this.rpc(server, "tools/call", { name, arguments: args });
    const text = (result?.content || []).filter((p) => p?.type === "text").map((p) => p.text ?? "").join("\n");
    return result?.isError ? JSON.stringify({ error: text || "MCP tool returned an error" }) : text;
  }

  async rpc(server, method, params, notification = false) {
    const message = { jsonrpc: "2.0", method };
    if (!notification) message.id = this.nextId++;
    if (params !== undefined) message.params = params;
    const headers = {
      [PROXY_HEADER + "Content-Type"]: "application/json",
      [PROXY_HEADER + "Accept"]: "application/json, text/event-stream",
    };
    if (server.session) headers[PROXY_HEADER + "Mcp-Session-Id"] = server.session;
    const response = await this.api.fetch("cors-proxy?url=" + encodeURIComponent(server.url),
      { method: "POST", headers, body: JSON.stringify(message) });
    const session = response.headers.get("mcp-session-id");
    if (session) server.session = session;
    if (notification) return null;
    let reply = null;
    if ((response.headers.get("content-type") || "").includes("text/event-stream")) {
      for await (const data of sseEvents(response.body)) {
        const m = JSON.parse(data);
        if (m.id === message.id) { reply = m; break; }
      }
    } else {
      reply = await response.json().catch(() => null);
    }
    if (!response.ok && !reply?.error) throw new Error(`${method}: HTTP ${response.status}${reply?.error?.message ? " " + reply.error.message : ""}`);
    if (!reply) throw new Error(`${method}: no answer`);
    if (reply.error) throw new Error(`${method}: ${reply.error.message || "error"}`);
    return reply.result;
  }
}
