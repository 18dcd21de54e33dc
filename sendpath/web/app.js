// sendpath's page: follow one message through the stack, and watch the fleet.
// Plain browser JavaScript, no build step. Talks to the gateway it was served from.
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY_STORE = "sendpath.apiKey";
// The pipeline boxes, and which trace stages each one stands for.
const BOXES = {
  network: ["network"],
  gateway: ["gateway.auth", "gateway.ratelimit", "gateway.safety"],
  queue: ["gateway.queue"],
  route: ["route"],
  replica: ["tokenize", "engine.queue", "prefill"],
  decode: ["decode"],
  stream: ["stream"],
};

function light(names, cls = "lit") {
  for (const li of document.querySelectorAll("#pipeline li")) {
    li.classList.toggle(cls, names.includes(li.dataset.stage));
  }
}

function resetPipeline() {
  for (const li of document.querySelectorAll("#pipeline li")) {
    li.classList.remove("lit", "done");
    li.querySelector(".ms")?.remove();
  }
}

function showError(text) {
  const box = $("#error");
  box.textContent = text;
  box.hidden = false;
  light([]);
}

// What a person needs to know about an error answer.
function explain(status, body, headers) {
  const err = (body && body.error) || {};
  const message = err.message || `HTTP ${status}`;
  if (status === 401) return `Your API key was not accepted: ${message}`;
  if (status === 429) {
    const wait = headers.get("retry-after");
    if (err.code === "insufficient_quota") return `This key's daily quota is used up. ${message}`;
    return `Rate limited: ${message}` + (wait ? ` Try again in ${wait} s.` : "");
  }
  if (err.code === "content_filter") return `Blocked by the safety filter. ${message}`;
  if (status === 503) {
    const wait = headers.get("retry-after");
    return `The service is busy: ${message}` + (wait ? ` Try again in ${wait} s.` : "");
  }
  return message;
}

async function send(event) {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  localStorage.setItem(KEY_STORE, key);
  const answer = $("#answer");
  answer.textContent = "";
  answer.dataset.chunks = "0";
  $("#error").hidden = true;
  $("#waterfall").hidden = true;
  $("#cached").hidden = true;
  resetPipeline();
  $("#send").disabled = true;
  light(["network", "gateway"]);
  $("#status").textContent = "sent...";
  const follow = { on: false };
  try {
    const models = await fetch("/v1/models", { headers: auth(key) });
    if (!models.ok) {
      showError(explain(models.status, await models.json().catch(() => null), models.headers));
      return;
    }
    const model = (await models.json()).data[0].id;
    const clientId = crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2);
    follow.on = true;
    const started = performance.now();
    followStages(clientId, key, follow, answer);
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", "x-sendpath-client-id": clientId, ...auth(key) },
      body: JSON.stringify({
        model,
        messages: [{ role: "user", content: $("#message").value }],
        max_tokens: Number($("#max-tokens").value) || 64,
        temperature: 0,
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!response.ok) {
      follow.on = false;
      showError(explain(response.status, await response.json().catch(() => null), response.headers));
      return;
    }
    const result = await readStream(response, answer);
    follow.on = false;
    const clientMs = performance.now() - started;
    light([]);
    if (result.error) {
      showError(`The answer broke off: ${result.error.message}`);
      return;
    }
    $("#status").textContent = `finished (${result.finish}) in ${Math.round(clientMs)} ms`;
    await showTrace(result, clientMs, key);
  } catch (err) {
    showError(`The server could not be reached (${err.message}). Is sendpath serve running?`);
  } finally {
    follow.on = false;
    $("#send").disabled = false;
  }
}

// Until the first token arrives, ask the gateway where the message is, ten times a
// second: a gateway stage, the queue, the route, or inside the replica (its engine queue,
// tokenizing, prefill with how much of the prompt is done).
const BOX_OF = {
  "gateway.auth": "gateway", "gateway.ratelimit": "gateway", "gateway.safety": "gateway",
  "gateway.queue": "queue", route: "route", tokenize: "replica", "engine.queue": "replica",
  prefill: "replica", decode: "decode",
};
async function followStages(clientId, key, follow, answer) {
  window.stagesSeen = [];
  while (follow.on && answer.dataset.chunks === "0") {
    try {
      const r = await fetch(`/v1/progress/${clientId}`, { headers: auth(key) });
      if (r.ok && follow.on && answer.dataset.chunks === "0") {
        const p = await r.json();
        if (window.stagesSeen[window.stagesSeen.length - 1] !== p.stage) window.stagesSeen.push(p.stage);
        const box = BOX_OF[p.stage] || "gateway";
        light(box === "decode" ? ["decode"] : [box]);
        let text = `now: ${p.stage}`;
        if (p.stage === "prefill" && p.engine) {
          text += ` (${Math.round(100 * p.prefill_done)}% of ${p.engine.num_prompt_tokens} prompt tokens)`;
        }
        $("#status").textContent = text;
      }
    } catch (err) { /* the answer itself will say what went wrong */ }
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

function auth(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Read the SSE stream, showing each text chunk the moment it arrives.
async function readStream(response, answer) {
  const out = { id: null, timings: null, usage: null, finish: null, error: null };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const raw = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!raw.startsWith("data:")) continue;
      const data = raw.slice(5).trim();
      if (data === "[DONE]") return out;
      const chunk = JSON.parse(data);
      if (chunk.error) { out.error = chunk.error; return out; }
      out.id = out.id || chunk.id;
      if (chunk.timings) out.timings = chunk.timings;
      if (chunk.usage) out.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const text = choice.delta && choice.delta.content;
        if (text) {
          if (answer.dataset.chunks === "0") {
            light(["decode", "stream"]);
            $("#status").textContent = "decoding: one token at a time...";
          }
          answer.textContent += text;
          answer.dataset.chunks = String(Number(answer.dataset.chunks) + 1);
        }
        if (choice.finish_reason) out.finish = choice.finish_reason;
      }
    }
  }
  return out;
}

async function showTrace(result, clientMs, key) {
  let stages = null;
  const got = await fetch(`/v1/traces/${result.id}`, { headers: auth(key) });
  if (got.ok) stages = (await got.json()).stages;
  if (!stages && result.timings) {  // no trace kept: lay the timings end to end
    let t = 0;
    stages = Object.entries(result.timings)
      .filter(([name]) => name !== "ttft" && name !== "total")
      .map(([stage, ms]) => { const s = { stage, start_ms: t, duration_ms: ms }; t += ms; return s; });
  }
  if (!stages) return;
  const serverMs = result.timings ? result.timings.total : 0;
  const networkMs = Math.max(0, clientMs - serverMs);
  drawWaterfall(stages, networkMs);
  markPipeline(stages, networkMs);
  if (result.usage) {
    const cached = (result.usage.prompt_tokens_details || {}).cached_tokens || 0;
    $("#cached").textContent =
      `${result.usage.prompt_tokens} prompt tokens, ${cached} of them from the prefix cache; ` +
      `${result.usage.completion_tokens} generated.`;
    $("#cached").hidden = false;
  }
}

function drawWaterfall(stages, networkMs) {
  const serverEnd = Math.max(...stages.map((s) => s.start_ms + s.duration_ms));
  const total = serverEnd + networkMs;
  const rows = stages.map((s) => ({ name: s.stage, ms: s.duration_ms, spans: [[networkMs / 2 + s.start_ms, s.duration_ms]] }));
  rows.push({ name: "network", ms: networkMs, spans: [[0, networkMs / 2], [networkMs / 2 + serverEnd, networkMs / 2]] });
  const body = $("#waterfall tbody");
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    tr.dataset.stage = row.name;
    const bars = row.spans.map(([start, ms]) =>
      `<span style="left:${(100 * start) / total}%;width:${(100 * ms) / total}%"></span>`).join("");
    tr.innerHTML = `<td>${row.name}</td><td class="num">${row.ms.toFixed(1)}</td>` +
      `<td class="num">${((100 * row.ms) / total).toFixed(1)}%</td>` +
      `<td><div class="track ${row.name === "network" ? "network" : ""}">${bars}</div></td>`;
    body.appendChild(tr);
  }
  const tr = document.createElement("tr");
  tr.innerHTML = `<th>total</th><th class="num">${total.toFixed(1)}</th><th class="num">100%</th><th></th>`;
  body.appendChild(tr);
  $("#waterfall").hidden = false;
}

function markPipeline(stages, networkMs) {
  const ms = Object.fromEntries(stages.map((s) => [s.stage, s.duration_ms]));
  ms.network = networkMs;
  for (const li of document.querySelectorAll("#pipeline li")) {
    const sum = BOXES[li.dataset.stage].reduce((a, name) => a + (ms[name] || 0), 0);
    li.classList.add("done");
    const label = document.createElement("span");
    label.className = "ms";
    label.textContent = `${sum.toFixed(1)} ms`;
    li.appendChild(label);
  }
}

// What a replica reports about itself goes into markup escaped.
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

// The fleet: polled once a second from the gateway.
async function pollFleet() {
  try {
    const r = await fetch("/fleet");
    const fleet = await r.json();
    const g = fleet.gateway;
    $("#gateway-line").textContent =
      `gateway: ${g.in_flight} in flight of ${g.capacity}, ${g.waiting} waiting in its queue; ` +
      `routing ${g.policy}`;
    const body = $("#replicas tbody");
    body.replaceChildren();
    for (const rep of fleet.replicas) {
      const tr = document.createElement("tr");
      const pct = (x) => (x == null ? "-" : `${(100 * x).toFixed(0)}%`);
      // `serve` reports its replica processes: one that exited is being started again
      const state = rep.process === "restarting" ? "restarting" : rep.healthy ? "healthy" : "out";
      const restarts = rep.restarts ? ` (${rep.restarts} restart${rep.restarts > 1 ? "s" : ""})` : "";
      // a cluster engine's replica: the host and Ray node it runs on
      const where = rep.runs_on
        ? `<br><small class="where" title="Ray node ${esc(rep.runs_on.node)}">${esc(rep.runs_on.host)} · node ${esc(rep.runs_on.node.slice(0, 6))}</small>`
        : "";
      // how the router matches prompts on it: precise (its KV events) or approximate
      const mode = rep.prefix_routing ? rep.prefix_routing.mode : "";
      tr.innerHTML = `<td>${esc(rep.name)}<br><small>${esc(rep.url.replace(/^https?:\/\//, ""))}</small>${where}</td>` +
        `<td class="${rep.healthy ? "health-ok" : "health-down"}">${state}${restarts}</td>` +
        `<td class="num">${rep.running ?? "-"}</td><td class="num">${rep.waiting ?? "-"}</td>` +
        `<td class="num">${pct(rep.kv_cache_usage)}</td>` +
        `<td class="num">${pct(rep.prefix_cache_hit_rate)}<br><small>${esc(mode)}</small></td>`;
      body.appendChild(tr);
    }
  } catch (err) {
    $("#gateway-line").textContent = `the gateway could not be reached (${err.message})`;
  }
}

// What if: four sliders (log scales for rate and lengths) run the simulator on the server.
const SCALES = {
  rate: [0.05, 200], prompt: [16, 100000], "answer-len": [16, 4096],
};
const PRESETS = {
  quiet: { rate: 0.2, prompt: 32, "answer-len": 256, replicas: 1 },
  overloaded: { rate: 100, prompt: 512, "answer-len": 512, replicas: 1 },
  long: { rate: 0.02, prompt: 100000, "answer-len": 64, replicas: 1 },
};
const COLORS = {
  "engine.queue": "#e67e22", "gateway.queue": "#f39c12", prefill: "#8e44ad", tokenize: "#9b59b6",
  decode: "#3a6ff7", network: "#b14ccf", route: "#16a085",
};
const fromSlider = (id) => {
  const [lo, hi] = SCALES[id];
  return lo * Math.pow(hi / lo, Number($(`#${id}`).value) / 100);
};
const toSlider = (id, v) => {
  const [lo, hi] = SCALES[id];
  $(`#${id}`).value = String(Math.round((100 * Math.log(v / lo)) / Math.log(hi / lo)));
};
function whatIfValues() {
  return {
    rate: Number(fromSlider("rate").toPrecision(2)),
    prompt: Math.round(fromSlider("prompt")),
    answer: Math.round(fromSlider("answer-len")),
    replicas: Number($("#replicas-n").value),
  };
}
let whatIfTimer = null;
let whatIfSeq = 0;
function whatIfChanged() {
  const v = whatIfValues();
  $("#rate-out").textContent = v.rate;
  $("#prompt-out").textContent = v.prompt;
  $("#answer-out").textContent = v.answer;
  $("#replicas-out").textContent = v.replicas;
  clearTimeout(whatIfTimer);
  whatIfTimer = setTimeout(() => runWhatIf(v), 250);
}
async function runWhatIf(v) {
  const seq = ++whatIfSeq;
  $("#whatif-line").textContent = "simulating...";
  const key = $("#api-key").value.trim();
  try {
    const q = new URLSearchParams({ rate: v.rate, prompt: v.prompt, answer: v.answer, replicas: v.replicas });
    const r = await fetch(`/v1/whatif?${q}`, { headers: auth(key) });
    const body = await r.json();
    if (seq !== whatIfSeq) return;  // a newer slider position is on its way
    if (!r.ok) {
      $("#whatif-line").textContent = r.status === 401
        ? "Enter your API key above to run the simulator." : body.error.message;
      return;
    }
    drawShares(body);
  } catch (err) {
    $("#whatif-line").textContent = `the gateway could not be reached (${err.message})`;
  }
}
function drawShares(result) {
  const bar = $("#shares");
  bar.replaceChildren();
  const shares = {};
  for (const [name, v] of Object.entries(result.stages)) {
    if (v.share < 0.005) continue;
    shares[name] = v.share;
    const span = document.createElement("span");
    span.style.width = `${100 * v.share}%`;
    span.style.background = COLORS[name] || "#95a5a6";
    span.title = `${name}: ${(100 * v.share).toFixed(1)}%`;
    span.textContent = v.share > 0.08 ? name : "";
    bar.appendChild(span);
  }
  bar.dataset.shares = JSON.stringify(shares);
  const why = {
    queue: "requests wait for a slot",
    prefill: "the prompt takes a visible share",
    decode: "tokens come one at a time",
  }[result.dominant_stage] || "";
  $("#whatif-line").textContent =
    `${result.dominant_stage} dominates (${why}); median TTFT ${Math.round(result.median_ttft_ms)} ms, ` +
    `median E2E ${Math.round(result.median_e2el_ms)} ms, busy ${result.utilization.map((u) => `${Math.round(100 * u)}%`).join(", ")}`;
}
for (const id of ["rate", "prompt", "answer-len", "replicas-n"]) {
  $(`#${id}`).addEventListener("input", whatIfChanged);
}
for (const button of document.querySelectorAll("[data-preset]")) {
  button.addEventListener("click", () => {
    const p = PRESETS[button.dataset.preset];
    for (const id of ["rate", "prompt", "answer-len"]) toSlider(id, p[id]);
    $("#replicas-n").value = String(p.replicas);
    whatIfChanged();
  });
}

$("#api-key").value = localStorage.getItem(KEY_STORE) || "";
whatIfChanged();
$("#send-form").addEventListener("submit", send);
pollFleet();
setInterval(pollFleet, 1000);
