// The chat page: conversations and settings in localStorage, replies streamed from this server's
// /v1/chat/completions (OpenAI's server-sent events) with fetch and a stream reader; Stop aborts the fetch, which
// closes the connection, and the server stops generating at the next token. Model text reaches the DOM only as
// textContent (the user's turns) or through markdown.js (the model's).
import { setMarkdown } from "/web/markdown.js";

const $ = (id) => document.getElementById(id);
const KEYS = { settings: "pyllm.settings", conversations: "pyllm.conversations", current: "pyllm.current" };
const DEFAULTS = { model: "", temperature: 0.7, max_tokens: "", top_p: 1, api_key: "", system: "" };
const UNTITLED = "New chat";

// ------------------------------------------------------------------------------------------------------ storage
function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch {
    return fallback; // unreadable (edited by hand, another page's data): start over rather than break the page
  }
}

function save() {
  try {
    localStorage.setItem(KEYS.settings, JSON.stringify(settings));
    localStorage.setItem(KEYS.conversations, JSON.stringify(conversations));
    localStorage.setItem(KEYS.current, JSON.stringify(currentId));
  } catch (e) {
    setStatus(`could not save the conversation in this browser: ${e.message}`, true);
  }
}

function validConversation(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages) &&
    c.messages.every((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
}

let settings = { ...DEFAULTS, ...load(KEYS.settings, {}) };
let conversations = load(KEYS.conversations, []);
conversations = Array.isArray(conversations) ? conversations.filter(validConversation) : [];
let currentId = load(KEYS.current, null);
let streaming = null; // {controller, conv, reply} while a reply streams

function newConversation() {
  const conv = { id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now() + Math.random()), title: UNTITLED,
    messages: [], updated: Date.now() };
  conversations.unshift(conv);
  currentId = conv.id;
  return conv;
}

function current() {
  const conv = conversations.find((c) => c.id === currentId) || conversations[0] || newConversation();
  currentId = conv.id;
  return conv;
}

// ------------------------------------------------------------------------------------------------------ rendering
function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

function renderSidebar() {
  const nav = $("conversations");
  nav.replaceChildren();
  for (const conv of [...conversations].sort((a, b) => b.updated - a.updated)) {
    const row = document.createElement("div");
    row.className = "conv" + (conv.id === currentId ? " current" : "");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conv.title;
    open.title = conv.title;
    open.addEventListener("click", () => { currentId = conv.id; save(); render(); });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", "Delete " + conv.title);
    del.addEventListener("click", () => {
      if (streaming && streaming.conv === conv) streaming.controller.abort();
      conversations = conversations.filter((c) => c !== conv);
      if (currentId === conv.id) currentId = conversations[0] ? conversations[0].id : null;
      save();
      render();
    });
    row.append(open, del);
    nav.append(row);
  }
}

function messageElement(msg) {
  const el = document.createElement("div");
  el.className = "msg " + msg.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = msg.role === "user" ? "You" : (msg.model || "Assistant");
  const body = document.createElement("div");
  body.className = "body";
  const note = document.createElement("div");
  note.className = "note";
  el.append(role, body, note);
  fillMessage(el, msg);
  return el;
}

function fillMessage(el, msg) {
  const body = el.querySelector(".body");
  if (msg.role === "user") body.textContent = msg.content;
  else setMarkdown(body, msg.content);
  const note = el.querySelector(".note");
  note.textContent = msg.error ? "Error: " + msg.error : (msg.note || "");
  note.classList.toggle("error", Boolean(msg.error));
  el.classList.toggle("streaming", Boolean(streaming && streaming.reply === msg));
}

function render() {
  const conv = current();
  renderSidebar();
  const box = $("messages");
  box.replaceChildren(...conv.messages.map(messageElement));
  if (!conv.messages.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "Ask anything. The conversation stays in this browser.";
    box.append(empty);
  }
  box.scrollTop = box.scrollHeight;
  const busy = Boolean(streaming);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

let frame = 0;
function renderReply() {
  // one re-render per animation frame however many chunks arrived: markdown re-renders the whole reply
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    if (!streaming || streaming.conv.id !== currentId) return;
    const box = $("messages");
    const near = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    const el = box.lastElementChild;
    if (el) fillMessage(el, streaming.reply);
    if (near) box.scrollTop = box.scrollHeight;
  });
}

// ------------------------------------------------------------------------------------------------------ server
function headers() {
  const h = { "Content-Type": "application/json" };
  if (settings.api_key) h.Authorization = "Bearer " + settings.api_key;
  return h;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch { /* not JSON: the status says it */ }
  return `HTTP ${response.status}`;
}

async function loadModels() {
  setStatus("");
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    setStatus(`the server does not answer: ${e.message}`, true);
    return;
  }
  if (response.status === 401) {
    $("model-name").textContent = "pyllm";
    setStatus("this server needs an API key: enter it in Settings", true);
    return;
  }
  if (!response.ok) {
    setStatus(await errorOf(response), true);
    return;
  }
  const models = (await response.json()).data || [];
  const select = $("model");
  select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  if (!models.some((m) => m.id === settings.model) && models.length) settings.model = models[0].id;
  select.value = settings.model;
  const card = models.find((m) => m.id === settings.model);
  $("model-name").textContent = settings.model || "pyllm";
  if (card && card.meta && card.meta.n_ctx) $("model-name").title = `context ${card.meta.n_ctx} tokens`;
  // Under --api-key the list stays open (as llama-server's) but a model's own card does not: asking for it tells
  // whether replies will need the key, before the first message fails.
  if (models.length) {
    const probe = await fetch(`/v1/models/${encodeURIComponent(settings.model)}`, { headers: headers() });
    if (probe.status === 401) setStatus("this server needs an API key: enter it in Settings", true);
  }
}

function requestBody(conv) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  // turns that failed before any text are left out: the model never said them
  for (const m of conv.messages.slice(0, -1)) {
    if (m.role === "user" || m.content) messages.push({ role: m.role, content: m.content });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (settings.model) body.model = settings.model;
  const number = (v) => (v === "" || v === null || !Number.isFinite(Number(v)) ? null : Number(v));
  if (number(settings.temperature) !== null) body.temperature = number(settings.temperature);
  if (number(settings.top_p) !== null) body.top_p = number(settings.top_p);
  if (number(settings.max_tokens) !== null) body.max_tokens = number(settings.max_tokens);
  return body;
}

// Reads OpenAI's server-sent events from ``response``; onChunk gets each parsed chunk until data: [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      onChunk(chunk);
    }
  }
}

async function send(text) {
  const conv = current();
  conv.messages.push({ role: "user", content: text });
  if (conv.title === UNTITLED) conv.title = text.replace(/\s+/g, " ").trim().slice(0, 60) || UNTITLED;
  const reply = { role: "assistant", content: "", model: settings.model };
  conv.messages.push(reply);
  conv.updated = Date.now();
  const controller = new AbortController();
  streaming = { controller, conv, reply };
  save();
  render();
  setStatus("generating…");
  const started = performance.now();
  let first = 0;
  let usage = null;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(conv)), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    await readEvents(response, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        if (!first) first = performance.now();
        reply.content += delta;
        renderReply();
      }
    });
    const seconds = (performance.now() - (first || started)) / 1000;
    const n = usage ? usage.completion_tokens : 0;
    reply.note = (n ? `${n} tokens, ${(n / Math.max(seconds, 1e-3)).toFixed(1)} tokens/s` : "") +
      (finish === "length" ? " · stopped at the token limit" : "");
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note = "stopped";
      setStatus("");
    } else {
      reply.error = e.message;
      setStatus(e.message, true);
    }
  } finally {
    streaming = null;
    conv.updated = Date.now();
    save();
    render();
  }
}

// ------------------------------------------------------------------------------------------------------ controls
function bindSettings() {
  const fields = { model: "model", temperature: "temperature", "max-tokens": "max_tokens", "top-p": "top_p",
    "api-key": "api_key", "system-prompt": "system" };
  for (const [id, key] of Object.entries(fields)) {
    const el = $(id);
    if (el.tagName !== "SELECT") el.value = settings[key];
    el.addEventListener("change", () => {
      settings[key] = el.value;
      save();
      if (key === "api_key" || key === "model") loadModels();
    });
  }
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
  $("reset-settings").addEventListener("click", () => {
    settings = { ...DEFAULTS, api_key: settings.api_key, model: settings.model };
    for (const [id, key] of Object.entries(fields)) if ($(id).tagName !== "SELECT") $(id).value = settings[key];
    save();
  });
}

function bindComposer() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value;
    if (!text.trim() || streaming) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (streaming) streaming.controller.abort(); });
  $("new-chat").addEventListener("click", () => {
    const conv = current();
    if (conv.messages.length) newConversation();
    save();
    render();
    prompt.focus();
  });
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest("button.copy");
    if (!button) return;
    const code = button.closest(".code").querySelector("code").textContent;
    navigator.clipboard.writeText(code).then(() => { button.textContent = "Copied"; },
      () => { button.textContent = "Copy failed"; });
  });
}

bindSettings();
bindComposer();
render();
loadModels();
