// The playground: a chat over the server's own OpenAI-compatible API, showing per turn what the
// cache reused. No dependencies, no build step. All URLs are relative to the page, so the page
// works wherever the app is mounted (a Serve route prefix).
//
//   conversation mode   POST v1/chat/completions {conversation_id, cache_salt, messages: [new]}
//   stateless mode      POST v1/chat/completions {cache_salt, messages: [whole history]}
//   fork / regenerate   POST v1/responses {previous_response_id: an earlier turn's response_id}:
//                       the server copies the turns up to it into a new conversation
"use strict";

const $ = (id) => document.getElementById(id);
const SOURCES = { head: "conversation head", prefix: "prefix", system: "system prompt" };
const store = window.sessionStorage;

const state = {
  model: null,
  apiKey: store.getItem("hybridserve.apiKey") || "",
  salt: store.getItem("hybridserve.salt") || `playground-${randomId()}`,
  mode: "conversation",          // or "stateless"
  branches: [],                  // {name, conversationId, forkFrom, turns: [Turn]}
  active: 0,
  busy: false,
};
store.setItem("hybridserve.salt", state.salt);

function randomId() {
  return Array.from(crypto.getRandomValues(new Uint8Array(6)), (b) => b.toString(16).padStart(2, "0")).join("");
}

function newBranch(name, turns = [], forkFrom = null) {
  return { name, conversationId: null, forkFrom, turns };
}

function branch() { return state.branches[state.active]; }

// -- the API -------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
  return h;
}

class APIError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function failure(response) {
  // The server's errors are OpenAI error bodies: show their message as it is.
  let message = `${response.status} ${response.statusText}`;
  try { message = (await response.json()).error.message || message; } catch (e) { /* not JSON */ }
  return new APIError(response.status, message);
}

// Yields each server-sent event's parsed data (chat completions: `data:` lines only; the
// Responses API adds `event:` lines, whose type is repeated in the data).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const line = block.split("\n").find((l) => l.startsWith("data: "));
      if (!line || line === "data: [DONE]") continue;
      yield JSON.parse(line.slice(6));
    }
  }
}

async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw await failure(response);
  return response;
}

function sampling() {
  const body = {
    model: state.model,
    temperature: Number($("temperature").value),
    cache_salt: state.salt,
    stream: true,
  };
  if ($("deterministic").checked) body.deterministic = true;
  return body;
}

function maxTokens() { return Math.max(1, Number($("max-tokens").value) || 128); }

// One turn through chat completions; `onText` gets each streamed piece.
async function chatTurn(b, text, onText) {
  const system = $("system-prompt").value.trim();
  const opening = b.turns.length === 1 && system ? [{ role: "system", content: system }] : [];
  const body = { ...sampling(), max_tokens: maxTokens(), stream_options: { include_usage: true } };
  if (state.mode === "conversation") {
    b.conversationId = b.conversationId || `pg-${randomId()}`;
    body.conversation_id = b.conversationId;
    body.messages = [...opening, { role: "user", content: text }];
  } else {
    const history = b.turns.slice(0, -1).flatMap((t) => [
      { role: "user", content: t.user }, { role: "assistant", content: t.reply }]);
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...history,
      { role: "user", content: text }];
  }
  const result = {};
  for await (const chunk of events(await post("v1/chat/completions", body))) {
    if (chunk.error) throw new APIError(0, chunk.error.message);
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (delta && delta.content) onText(delta.content);
    if (chunk.usage) {
      result.prompt = chunk.usage.prompt_tokens;
      result.cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
    }
    if (chunk.turn !== undefined) result.turn = chunk.turn;
    if (chunk.response_id) result.responseId = chunk.response_id;
    if (chunk.hybridserve) result.served = chunk.hybridserve;
  }
  return result;
}

// One turn through the Responses API, continuing (forking) from an earlier turn's response.
async function forkTurn(b, text, onText) {
  const body = { ...sampling(), max_output_tokens: maxTokens(), input: text, previous_response_id: b.forkFrom };
  const result = {};
  for await (const event of events(await post("v1/responses", body))) {
    if (event.type === "response.output_text.delta") onText(event.delta);
    else if (event.type === "error") throw new APIError(0, event.message);
    else if (event.type === "response.completed" || event.type === "response.incomplete") {
      const r = event.response;
      result.prompt = r.usage.input_tokens;
      result.cached = r.usage.input_tokens_details.cached_tokens;
      result.turn = b.turns.length;
      result.responseId = r.id;
      result.served = r.hybridserve;
      b.conversationId = r.conversation.id;
    }
  }
  b.forkFrom = null;
  return result;
}

// -- sending ---------------------------------------------------------------------------------

async function send(text) {
  if (state.busy || !text.trim()) return;
  const b = branch();
  const turn = { user: text, reply: "", chunks: 0, state: "streaming", n: b.turns.length + 1,
    deterministic: $("deterministic").checked };
  b.turns.push(turn);
  setBusy(true);
  hideError();
  render();
  const started = performance.now();
  const onText = (piece) => {
    if (turn.ttft === undefined) turn.ttft = performance.now() - started;
    turn.reply += piece;
    turn.chunks += 1;
    updateReply(turn);
  };
  try {
    const result = await (b.forkFrom ? forkTurn(b, text, onText) : chatTurn(b, text, onText));
    if (turn.ttft === undefined) turn.ttft = performance.now() - started;  // an empty reply
    Object.assign(turn, result, { state: "done" });
    if (result.turn) turn.n = result.turn;
  } catch (error) {
    b.turns.pop();  // nothing was committed: the message goes back to the composer
    $("composer-input").value = text;
    showError(error);
  } finally {
    setBusy(false);
    render();
  }
}

function fork(index, regenerate) {
  // Turns 1..index are kept (regenerate: 1..index-1, then its message is sent again).
  const source = branch();
  const keep = regenerate ? index - 1 : index;
  const turns = source.turns.slice(0, keep).map((t) => ({ ...t, inherited: true }));
  const name = regenerate ? `regenerate turn ${index}` : `fork from turn ${index}`;
  const forkFrom = state.mode === "conversation" && keep > 0 ? source.turns[keep - 1].responseId : null;
  state.branches.push(newBranch(name, turns, forkFrom));
  state.active = state.branches.length - 1;
  render();
  if (regenerate) send(source.turns[index - 1].user);
  else $("composer-input").focus();
}

// -- rendering -------------------------------------------------------------------------------

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function ms(value) {
  if (value === undefined) return "—";
  return value < 1000 ? `${Math.round(value)} ms` : `${(value / 1000).toFixed(2)} s`;
}

function stat(name, label, value, title) {
  const node = el("span", `stat stat-${name}`);
  node.append(el("span", "label", label), el("b", null, value));
  if (title) node.title = title;
  return node;
}

function turnStats(turn, index, last) {
  const stats = el("div", "stats");
  if (turn.state !== "done") return stats;
  const served = turn.served || {};
  const source = SOURCES[served.cached_from] || "none";
  const cached = stat("cached", "cached", `${turn.cached} / ${turn.prompt}`, "prompt tokens reused / prompt tokens");
  cached.dataset.value = turn.cached;
  if (turn.cached > 0) cached.classList.add("hit");
  stats.append(el("span", "stat turn-no", `turn ${turn.n}`), cached, stat("source", "from", source),
    stat("ttft", "TTFT", ms(turn.ttft)), stat("replica", "replica", (served.replica || "—").slice(-6),
      served.replica ? `Serve replica ${served.replica} (${served.recovery})` : ""));
  if (turn.deterministic) stats.append(el("span", "stat stat-deterministic", "deterministic"));
  const actions = el("span", "actions");
  const again = el("button", "link regen-btn", "↻ Regenerate");
  again.onclick = () => fork(index + 1, true);
  actions.append(again);
  if (!last) {  // forking from the latest turn would only continue the conversation
    const branchOff = el("button", "link fork-btn", "↳ Fork from here");
    branchOff.onclick = () => fork(index + 1, false);
    actions.append(branchOff);
  }
  stats.append(actions);
  return stats;
}

function updateReply(turn) {
  if (!turn.node) return;
  const reply = turn.node.querySelector(".reply");
  reply.textContent = turn.reply;
  reply.dataset.chunks = turn.chunks;
  scrollDown();
}

function scrollDown() { const t = $("transcript"); t.scrollTop = t.scrollHeight; }

function render() {
  const b = branch();
  const transcript = $("transcript");
  transcript.querySelectorAll(".turn").forEach((n) => n.remove());
  $("empty").hidden = b.turns.length > 0;
  b.turns.forEach((turn, index) => {
    const node = el("article", `turn${turn.inherited ? " inherited" : ""}`);
    node.dataset.turn = turn.n;
    node.dataset.state = turn.state;
    node.append(el("div", "bubble user", turn.user));
    const reply = el("div", "bubble reply", turn.reply);
    reply.dataset.chunks = turn.chunks;
    node.append(reply, turnStats(turn, index, index === b.turns.length - 1));
    turn.node = node;
    transcript.append(node);
  });
  scrollDown();
  renderBranches();
  renderChart(b.turns.filter((t) => t.state === "done"));
  $("conversation-id").textContent = state.mode === "conversation" ? b.conversationId || "(new)" : "stateless";
  $("cache-salt").textContent = state.salt;
  const note = $("fork-note");
  note.hidden = !b.forkFrom;
  note.textContent = b.forkFrom ? `Your next message continues turn ${b.turns.length} in a new conversation (a fork).` : "";
}

function renderBranches() {
  const nav = $("branches");
  nav.replaceChildren();
  nav.hidden = state.branches.length < 2;
  state.branches.forEach((b, i) => {
    const tab = el("button", `branch-tab${i === state.active ? " on" : ""}`, `${b.name} · ${b.turns.length}`);
    tab.onclick = () => { if (!state.busy) { state.active = i; render(); } };
    nav.append(tab);
  });
}

function renderChart(turns) {
  // Bars: TTFT measured here; dashed line: what computing the whole prompt would take, at
  // turn 1's rate (its TTFT per prompt token it computed).
  const svg = $("chart");
  const W = 300, H = 170, left = 48, bottom = 22, top = 10, right = 8;
  const first = turns[0];
  const rate = first ? first.ttft / Math.max(1, first.prompt - first.cached) : 0;
  const estimates = turns.map((t) => t.prompt * rate);
  const peak = Math.max(1, ...turns.map((t) => t.ttft), ...estimates);
  const x = (i) => left + (i + 0.5) * ((W - left - right) / Math.max(turns.length, 4));
  const y = (v) => H - bottom - (v / peak) * (H - bottom - top);
  const band = ((W - left - right) / Math.max(turns.length, 4)) * 0.55;
  const parts = [];
  if (!turns.length) {
    svg.innerHTML = `<text class="axis" x="${W / 2}" y="${H / 2}" text-anchor="middle">no turns yet</text>`;
    return;
  }
  for (const f of [0, 0.5, 1]) {
    parts.push(`<line class="grid" x1="${left}" x2="${W - right}" y1="${y(peak * f)}" y2="${y(peak * f)}"/>`,
      `<text class="axis" x="${left - 4}" y="${y(peak * f) + 3}" text-anchor="end">${ms(peak * f)}</text>`);
  }
  turns.forEach((t, i) => {
    parts.push(`<rect class="bar" x="${x(i) - band / 2}" y="${y(t.ttft)}" width="${band}" height="${H - bottom - y(t.ttft)}"><title>turn ${t.n}: ${ms(t.ttft)}</title></rect>`,
      `<text class="axis" x="${x(i)}" y="${H - 8}" text-anchor="middle">${t.n}</text>`);
  });
  const points = estimates.map((v, i) => `${x(i)},${y(v)}`).join(" ");
  parts.push(`<polyline class="estimate" points="${points}"/>`);
  estimates.forEach((v, i) => parts.push(`<circle class="estimate-dot" cx="${x(i)}" cy="${y(v)}" r="2.5"/>`));
  svg.innerHTML = parts.join("");
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("send").textContent = busy ? "…" : "Send";
}

function showError(error) {
  const banner = $("error-banner");
  banner.textContent = error.status ? `${error.status}: ${error.message}` : error.message;
  banner.hidden = false;
  if (error.status === 401) $("key-panel").hidden = false;
}

function hideError() { $("error-banner").hidden = true; }

// -- start -----------------------------------------------------------------------------------

async function loadModel() {
  // GET v1/models tells the model's name, and whether the server wants a key (401).
  const response = await fetch("v1/models", { headers: headers() });
  if (!response.ok) {
    const error = await failure(response);
    if (response.status === 401) $("key-panel").hidden = false;
    if (state.apiKey || response.status !== 401) showError(error);
    return;
  }
  state.model = (await response.json()).data[0].id;
  $("model-name").textContent = state.model;
  $("key-panel").hidden = !state.apiKey;
  hideError();
}

function startOver(mode) {
  state.mode = mode;
  state.branches = [newBranch("main")];
  state.active = 0;
  $("mode-conversation").classList.toggle("on", mode === "conversation");
  $("mode-stateless").classList.toggle("on", mode === "stateless");
  render();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("composer-input").value;
  $("composer-input").value = "";
  send(text);
});
$("composer-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("key-save").onclick = () => {
  state.apiKey = $("key-input").value.trim();
  store.setItem("hybridserve.apiKey", state.apiKey);
  loadModel();
};
$("mode-conversation").onclick = () => { if (!state.busy) startOver("conversation"); };
$("mode-stateless").onclick = () => { if (!state.busy) startOver("stateless"); };
$("new-chat").onclick = () => { if (!state.busy) startOver(state.mode); };

startOver("conversation");
loadModel();
