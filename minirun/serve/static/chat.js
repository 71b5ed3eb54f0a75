// The chat page: a conversation streamed from the server's own /v1/chat/completions.
// Requests are relative ("v1/...", "props"), so the page works wherever the server is mounted.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "minirun.apiKey";
const SETTINGS_STORE = "minirun.settings";

const state = {
  messages: [],       // the conversation as sent: [{role, content}]
  props: null,        // GET /props
  controller: null,   // the AbortController of the answer being streamed
  attachment: null,   // {name, text} to go with the next question
};

class ServerError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// ---- the server ------------------------------------------------------------------------------
async function loadProps() {
  try {
    const res = await fetch("props");
    if (!res.ok) throw new Error("HTTP " + res.status);
    state.props = await res.json();
  } catch (e) {
    $("model").textContent = "server unreachable";
    return;
  }
  const p = state.props;
  const cache = p.cache.kind === "hca" ? "HCA" + (p.cache.budget ? " " + p.cache.budget : "") : "dense";
  $("model").textContent = p.model;
  const name = document.createElement("span");
  name.className = "facts-model";         // (narrow screens: the name on this line, beside the figures)
  name.textContent = p.model + " · ";
  $("facts").replaceChildren(name, "context " + p.n_ctx.toLocaleString("en-US") + " tokens · " + cache + " cache");
  document.title = p.model + " · minirun";
}

function requestBody(messages) {
  const body = { model: state.props ? state.props.model : "default", messages,
                 stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function post(body, signal) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = "Bearer " + key;
    const res = await fetch("v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body), signal });
    if (res.ok) return res;
    const message = await errorMessage(res);
    if (res.status === 401) {
      localStorage.removeItem(KEY_STORE);
      showKeyButton();
      if (await askKey()) continue;
    }
    throw new ServerError(res.status, message);
  }
}

async function errorMessage(res) {
  const text = await res.text();
  try {
    return JSON.parse(text).error.message;
  } catch (e) {
    return "HTTP " + res.status + (text ? ": " + text.slice(0, 200) : "");
  }
}

// Server-sent events of one answer -> onChunk(parsed JSON) for each, until [DONE]
async function readEvents(res, onChunk) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (!data) continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(500, chunk.error.message);
      onChunk(chunk);
    }
  }
}

// ---- the conversation ------------------------------------------------------------------------
function addMessage(role) {
  $("welcome").hidden = true;
  const el = document.createElement("article");
  el.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  el.append(content);
  $("log").append(el);
  return el;
}

function addUserMessage(question, file) {
  const el = addMessage("user");
  if (file) {
    const chip = document.createElement("div");
    chip.className = "file";
    chip.textContent = "attached: " + file.name + " · " + file.text.length.toLocaleString("en-US") + " characters";
    el.prepend(chip);
  }
  el.querySelector(".content").textContent = question;
  scrollDown(true);
  return el;
}

function nearBottom() {
  const log = $("log");
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function scrollDown(force) {
  if (force || nearBottom()) $("log").scrollTop = $("log").scrollHeight;
}

function showStats(el, usage, timings, finish, stopped) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    stats.dataset.promptTokens = usage.prompt_tokens;
    stats.dataset.cachedTokens = cached;
    parts.push("prompt " + usage.prompt_tokens.toLocaleString("en-US") + " tokens (" +
               cached.toLocaleString("en-US") + " cached)");
    parts.push(usage.completion_tokens + " answer tokens");
  }
  if (timings && timings.decode_tps) {
    stats.dataset.tps = timings.decode_tps;
    parts.push(timings.decode_tps.toFixed(1) + " tokens/s");
  }
  if (timings && timings.first_text_s !== undefined) parts.push("first text in " + timings.first_text_s.toFixed(2) + " s");
  if (usage && state.props) {
    parts.push("context " + Math.round(100 * usage.total_tokens / state.props.n_ctx) + "% full");
  }
  if (stopped) parts.push("stopped");
  else if (finish === "length") parts.push("cut at the token limit");
  stats.textContent = parts.join(" · ");
  el.append(stats);
}

function showError(el, message) {
  el.dataset.state = "error";
  el.classList.add("error");
  const content = el.querySelector(".content");
  content.setAttribute("role", "alert");
  content.textContent = message;
}

async function ask(question) {
  const file = state.attachment;
  const content = file ? "--- " + file.name + " ---\n" + file.text + "\n--- end of " + file.name + " ---\n\n" + question
                       : question;
  const userEl = addUserMessage(question, file);
  const el = addMessage("assistant");
  el.dataset.state = "waiting";
  const view = el.querySelector(".content");
  view.innerHTML = '<span class="typing" aria-label="thinking"></span>';
  const waiting = waitingClock(view);
  const conversation = state.messages;   // (a new chat started meanwhile replaces it)
  conversation.push({ role: "user", content });
  setAttachment(null);

  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let text = "", usage = null, timings = null, finish = null, drawn = true;
  const draw = () => {
    clearInterval(waiting);
    view.innerHTML = minirunMarkdown.render(text);
    if (el.dataset.state === "waiting") el.dataset.state = "streaming";   // (the prefill is over)
    drawn = true;
    scrollDown();
  };
  try {
    const res = await post(requestBody(conversation), controller.signal);
    await readEvents(res, (chunk) => {
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        text += choice.delta.content;
        if (drawn) { drawn = false; requestAnimationFrame(draw); }
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) usage = chunk.usage;
    });
    draw();
    el.dataset.state = "done";
    conversation.push({ role: "assistant", content: text });
    showStats(el, usage, timings, finish, false);
  } catch (e) {
    if (e.name === "AbortError") {
      draw();
      el.dataset.state = "stopped";
      conversation.push({ role: "assistant", content: text });
      showStats(el, null, null, null, true);
    } else {
      conversation.pop();          // the question was not answered: it leaves the conversation
      userEl.classList.add("unsent");
      showError(el, e.message);
      if (!$("input").value) $("input").value = question;
    }
  } finally {
    clearInterval(waiting);
    state.controller = null;
    setBusy(false);
    scrollDown();
  }
}

// a long prompt takes a while before the first word: say how long it has been
function waitingClock(view) {
  const t0 = performance.now();
  const clock = setInterval(() => {
    const s = Math.round((performance.now() - t0) / 1000);
    if (s >= 2) view.innerHTML = '<span class="waiting">reading the prompt · ' + s + ' s</span><span class="typing"></span>';
  }, 1000);
  return clock;
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  for (const el of $("log").querySelectorAll(".msg")) el.remove();
  $("welcome").hidden = false;
  setAttachment(null);
  $("input").focus();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

// ---- attachments, the key, settings ----------------------------------------------------------
function setAttachment(file) {
  state.attachment = file;
  $("attachment").hidden = !file;
  $("attachment").classList.remove("error");
  $("attachment-name").textContent = file
    ? "attached: " + file.name + " · " + file.text.length.toLocaleString("en-US") + " characters, sent with the next question"
    : "";
  $("file").value = "";
}

async function attach(file) {
  const text = await file.text();
  if (text.includes("\u0000")) {            // a binary file: its bytes are not text
    setAttachment(null);
    $("attachment").hidden = false;
    $("attachment").classList.add("error");
    $("attachment-name").textContent = file.name + " is not a text file";
    return;
  }
  setAttachment({ name: file.name, text });
  $("input").focus();
}

function askKey() {
  const dialog = $("key-dialog");
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    const done = (key) => {
      $("key-form").onsubmit = $("key-cancel").onclick = dialog.oncancel = null;
      if (dialog.open) dialog.close();
      if (key) { localStorage.setItem(KEY_STORE, key); showKeyButton(); }
      resolve(Boolean(key));
    };
    $("key-form").onsubmit = (ev) => { ev.preventDefault(); done($("key-input").value.trim()); };
    $("key-cancel").onclick = () => done(null);
    dialog.oncancel = () => done(null);
  });
}

function showKeyButton() {
  $("forget-key").hidden = !localStorage.getItem(KEY_STORE);
}

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    if (saved.temperature !== undefined) $("temperature").value = saved.temperature;
    if (saved.maxTokens !== undefined) $("max-tokens").value = saved.maxTokens;
  } catch (e) { /* a setting from another version: the defaults */ }
}

function saveSettings() {
  localStorage.setItem(SETTINGS_STORE, JSON.stringify({ temperature: $("temperature").value,
                                                         maxTokens: $("max-tokens").value }));
}

function fitInput() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight + 2, window.innerHeight * 0.4) + "px";
}

// ---- wiring ----------------------------------------------------------------------------------
function submit() {
  const question = $("input").value.trim();
  if (!question || state.controller) return;
  $("input").value = "";
  fitInput();
  ask(question);
}

$("composer").addEventListener("submit", (ev) => { ev.preventDefault(); submit(); });
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); submit(); }
});
$("input").addEventListener("input", fitInput);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", newChat);
$("file").addEventListener("change", (ev) => ev.target.files[0] && attach(ev.target.files[0]));
$("detach").addEventListener("click", () => setAttachment(null));
$("settings-toggle").addEventListener("click", () => {
  const open = $("settings").hidden;
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
});
$("temperature").addEventListener("change", saveSettings);
$("max-tokens").addEventListener("change", saveSettings);
$("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); showKeyButton(); });

loadSettings();
showKeyButton();
loadProps();
$("input").focus();
