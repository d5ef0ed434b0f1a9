/* fedkey web keyboard: the page. Plain JS, no build step.
 *
 * Two modes: "server" sends the text before the caret over WS /ws/suggest on every keystroke;
 * "browser" runs the same ONNX model with onnxruntime-web (wasm, one thread) and the port of the
 * suggestion logic in suggest.js, so keystrokes never leave the device.
 * window.fedkeyTimings holds per-keystroke times in ms (server: round trip; browser: compute).
 */
(() => {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const input = $("input");
  const slots = Array.from(document.querySelectorAll('[data-testid="suggestion"]'));
  const modeSelect = $("mode");
  const statusEl = $("status");
  const MAX_SEND = 4000; // characters before the caret sent to the server (it reads the last 1000)
  const W = "\\p{L}\\p{N}_";
  const PARTIAL_RE = new RegExp(`[${W}]+(?:['\\-.\u2019][${W}]+)*['\\-\u2019]?$`, "u");

  const timings = { server: [], browser: [], browserModel: [] };
  window.fedkeyTimings = timings;
  const state = {
    mode: "server",
    info: null,
    serverReady: false,
    browserReady: false,
    browserRound: null,
    suggestions: [],
    round: null,
  };
  window.fedkey = state;

  function setStatus(text, error = false) {
    statusEl.textContent = text;
    statusEl.classList.toggle("error", error);
  }

  // Server mode's status line; it keeps saying why browser mode is unavailable, whichever of
  // the WebSocket and /api/info answers first.
  function serverStatus() {
    const bm = state.info && state.info.browser_mode;
    return bm && !bm.available
      ? `suggestions from the server · browser mode unavailable: ${bm.reason}`
      : "suggestions from the server";
  }

  // ---------------------------------------------------------------------------------------------
  // The on-screen keyboard
  // ---------------------------------------------------------------------------------------------
  const LAYOUT = [
    ["q", "w", "e", "r", "t", "y", "u", "i", "o", "p"],
    ["a", "s", "d", "f", "g", "h", "j", "k", "l", "'"],
    ["z", "x", "c", "v", "b", "n", "m", "backspace"],
    [",", "space", ".", "?"],
  ];
  const LABELS = { backspace: "⌫", space: "space" };

  function buildKeyboard() {
    const keys = $("keys");
    for (const row of LAYOUT) {
      const div = document.createElement("div");
      div.className = "row";
      for (const k of row) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "key" + (k === "backspace" ? " wide" : "") + (k === "space" ? " space" : "");
        b.dataset.key = k;
        b.setAttribute("data-testid", `key-${k}`);
        b.setAttribute("aria-label", k);
        b.textContent = LABELS[k] || k;
        div.appendChild(b);
      }
      keys.appendChild(div);
    }
    // Keep the focus (and the caret) in the text area when a key is pressed.
    keys.addEventListener("mousedown", (e) => e.preventDefault());
    keys.addEventListener("click", (e) => {
      const b = e.target.closest(".key");
      if (!b) return;
      pressKey(b.dataset.key);
    });
  }

  function pressKey(k) {
    if (k === "backspace") backspace();
    else insertText(k === "space" ? " " : k);
  }

  function caret() {
    return input.selectionStart ?? input.value.length;
  }

  function insertText(str) {
    const s = input.selectionStart ?? input.value.length;
    const e = input.selectionEnd ?? s;
    input.setRangeText(str, s, e, "end");
    changed();
  }

  function backspace() {
    let s = input.selectionStart ?? input.value.length;
    const e = input.selectionEnd ?? s;
    if (s === e) {
      if (s === 0) return;
      const code = input.value.charCodeAt(s - 1);
      s -= code >= 0xdc00 && code <= 0xdfff && s >= 2 ? 2 : 1; // a surrogate pair is one character
    }
    input.setRangeText("", s, e, "end");
    changed();
  }

  // A key typed while the focus is elsewhere (the mode switch, the page) still types.
  document.addEventListener("keydown", (e) => {
    const t = e.target;
    if (t === input || t.tagName === "SELECT" || t.tagName === "INPUT") return;
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key === "Backspace") backspace();
    else if (e.key.length === 1) insertText(e.key);
    else return;
    e.preventDefault();
    input.focus();
  });

  // ---------------------------------------------------------------------------------------------
  // Suggestions
  // ---------------------------------------------------------------------------------------------
  let seq = 0;
  let lastText = null;

  function textBeforeCaret() {
    return input.value.slice(0, caret());
  }

  function changed(force = false) {
    const text = textBeforeCaret();
    if (!force && text === lastText) return;
    lastText = text;
    seq += 1;
    if (state.mode === "browser") browserSuggest(text, seq);
    else serverSuggest(text, seq);
  }

  input.addEventListener("input", () => changed());
  for (const ev of ["keyup", "click", "select"]) input.addEventListener(ev, () => changed());

  function render(list, round) {
    state.suggestions = list;
    slots.forEach((b, i) => {
      b.textContent = list[i] || "";
      b.dataset.word = list[i] || "";
      b.disabled = !list[i];
    });
    if (round !== undefined && round !== null) setRound(round);
  }

  function accept(word) {
    const end = caret();
    const before = input.value.slice(0, end);
    const m = PARTIAL_RE.exec(before);
    const start = m ? end - m[0].length : end;
    let w = word;
    if (m && /^\p{Lu}/u.test(m[0])) w = w.charAt(0).toUpperCase() + w.slice(1);
    if (!m && before && !/\s$/u.test(before)) w = " " + w; // "hello," + word
    input.setRangeText(w + " ", start, input.selectionEnd ?? end, "end");
    input.focus();
    changed();
  }

  for (const b of slots) {
    b.addEventListener("mousedown", (e) => e.preventDefault());
    b.addEventListener("click", () => {
      if (b.dataset.word) accept(b.dataset.word);
    });
  }

  // -- server mode -------------------------------------------------------------------------------
  let ws = null;
  let wsBackoff = 250;
  const sentAt = new Map();
  let queued = null;

  function connectSuggest() {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/suggest`;
    ws = new WebSocket(url);
    ws.onopen = () => {
      wsBackoff = 250;
      state.serverReady = true;
      if (state.mode === "server") {
        setStatus(serverStatus());
        if (queued) serverSend(...queued);
        else changed(true);
      }
    };
    ws.onmessage = (ev) => {
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      const t0 = sentAt.get(msg.id);
      sentAt.delete(msg.id);
      if (state.mode !== "server") return;
      if (msg.error) {
        setStatus(msg.error, true);
        if (msg.id === seq) render([]);
        return;
      }
      if (t0 !== undefined) timings.server.push(performance.now() - t0);
      if (msg.id === seq) render(msg.suggestions, msg.round);
    };
    ws.onclose = () => {
      state.serverReady = false;
      if (state.mode === "server") setStatus("connection to the server lost, retrying…", true);
      setTimeout(connectSuggest, wsBackoff);
      wsBackoff = Math.min(wsBackoff * 2, 5000);
    };
  }

  function serverSend(text, id) {
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      queued = [text, id];
      return;
    }
    queued = null;
    sentAt.set(id, performance.now());
    if (sentAt.size > 1000) sentAt.clear();
    ws.send(JSON.stringify({ text: text.length > MAX_SEND ? text.slice(-MAX_SEND) : text, id }));
  }

  function serverSuggest(text, id) {
    serverSend(text, id);
  }

  // -- browser mode ------------------------------------------------------------------------------
  let ortPromise = null;
  let bSuggester = null;
  let bSession = null;
  let busy = false;
  let pending = null;

  function loadOrt() {
    if (window.ort) return Promise.resolve(window.ort);
    if (!ortPromise) {
      const src = (state.info && state.info.browser_mode.script) || "/vendor/ort.wasm.min.js";
      ortPromise = new Promise((resolve, reject) => {
        const s = document.createElement("script");
        s.src = src;
        s.onload = () => (window.ort ? resolve(window.ort) : reject(new Error("ort missing")));
        s.onerror = () => {
          ortPromise = null;
          reject(new Error(`could not load ${src}`));
        };
        document.head.appendChild(s);
      });
    }
    return ortPromise;
  }

  async function fetchModel() {
    for (let attempt = 0; attempt < 5; attempt++) {
      const meta = await (await fetch("/model.json", { cache: "no-store" })).json();
      const r = await fetch("/model.onnx", { cache: "no-store" });
      if (!r.ok) throw new Error(`GET /model.onnx: ${r.status}`);
      const bytes = new Uint8Array(await r.arrayBuffer());
      if (r.headers.get("X-Fedkey-Round") === String(meta.round)) return [meta, bytes];
      // A hot reload happened between the two requests: fetch both again.
    }
    throw new Error("the model changed while it was downloaded; try again");
  }

  async function loadBrowserModel() {
    state.browserReady = false;
    const t0 = performance.now();
    const ort = await loadOrt();
    ort.env.wasm.numThreads = 1; // no SharedArrayBuffer needed
    ort.env.wasm.proxy = false;
    ort.env.wasm.wasmPaths = "/vendor/";
    const [meta, bytes] = await fetchModel();
    const session = await ort.InferenceSession.create(bytes, {
      executionProviders: ["wasm"],
      graphOptimizationLevel: "all",
    });
    const sugg = await new window.FedkeySuggest.Suggester(ort, session, meta).init();
    bSuggester = sugg;
    bSession = sugg.newSession();
    state.browserRound = meta.round;
    state.browserReady = true;
    state.browserLoadMs = performance.now() - t0;
    return meta;
  }

  async function browserSuggest(text, id) {
    if (!bSession) {
      pending = [text, id];
      return;
    }
    if (busy) {
      pending = [text, id]; // only the latest text matters
      return;
    }
    busy = true;
    try {
      let job = [text, id];
      while (job) {
        const [t, i] = job;
        pending = null;
        const session = bSession;
        const calls = session.suggester.calls;
        const t0 = performance.now();
        const res = await session.suggest(t);
        const dt = performance.now() - t0;
        timings.browser.push(dt);
        if (session.suggester.calls > calls) timings.browserModel.push(dt);
        if (state.mode === "browser" && i === seq) render(res.suggestions, res.round);
        job = pending;
      }
    } catch (e) {
      setStatus(`in-browser model failed: ${e.message || e}`, true);
    } finally {
      busy = false;
    }
  }

  async function setMode(mode) {
    if (mode === "browser") {
      const bm = state.info && state.info.browser_mode;
      if (bm && !bm.available) {
        setStatus(`browser mode unavailable: ${bm.reason}`, true);
        modeSelect.value = "server";
        return;
      }
      state.mode = "browser";
      document.body.dataset.mode = "browser";
      $("served-by").textContent = "browser";
      render([]);
      if (!bSession || state.browserRound !== state.round) {
        setStatus("loading the model into the browser…");
        try {
          const meta = await loadBrowserModel();
          showModel({ ...meta, ...(meta.metrics || {}) });
        } catch (e) {
          setStatus(`browser mode failed: ${e.message || e}`, true);
          modeSelect.value = "server";
          return setMode("server");
        }
      }
      setStatus("model runs in this browser (wasm): keystrokes stay here");
      changed(true);
    } else {
      state.mode = "server";
      document.body.dataset.mode = "server";
      $("served-by").textContent = "server";
      setStatus(state.serverReady ? serverStatus() : "connecting…");
      changed(true);
    }
  }

  modeSelect.addEventListener("change", async () => {
    await setMode(modeSelect.value);
    input.focus();
  });

  // ---------------------------------------------------------------------------------------------
  // The model panel and the chart
  // ---------------------------------------------------------------------------------------------
  function fmt(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return x >= 100 ? x.toFixed(0) : x.toFixed(1);
  }

  function setRound(r) {
    state.round = r;
    $("round").textContent = r === null || r === undefined ? "–" : String(r);
    drawChart();
  }

  // The privacy block: what the served export records (fedkey.export.metadata.privacy_facts), said as
  // it is: epsilon so far against the budget at its delta, rho-zCDP and the mechanism (gaussian,
  // or DP-FTRL's tree or BLT with its separation b), "none" without DP, "not recorded" for an old
  // export.
  const isNum = (x) => typeof x === "number" && isFinite(x);
  // DP-FTRL's mechanisms (fedkey.common.config.FTRL_MECHANISMS) as the panel names them.
  const FTRL = { tree: "DP-FTRL tree aggregation", blt: "DP-FTRL BLT matrix factorization" };
  const sig = (x) => String(Number(x.toPrecision(3)));
  const sci = (x) => Number(x.toPrecision(3)).toExponential();

  function privacyText(p) {
    if (!p || p.dp === null || p.dp === undefined) return [["not recorded in this export", []], ""];
    if (!p.dp) return [["no differential privacy (epsilon: none)", []], ""];
    const details = [];
    let eps = "not recorded";
    if (p.epsilon === "inf") {
      eps = "∞";
      details.push("no guarantee (infinite epsilon)");
    } else if (isNum(p.epsilon)) {
      eps = sig(p.epsilon);
    }
    const budget = isNum(p.target_epsilon) ? ` of budget ${sig(p.target_epsilon)}` : ", no budget set";
    const tail = [];
    if (isNum(p.delta)) tail.push(`(delta ${sci(p.delta)})`);
    if (p.rho === "inf") tail.push("rho ∞");
    else if (isNum(p.rho)) tail.push(`rho ${sig(p.rho)}`);
    if (FTRL[p.mechanism]) {
      const b = Number.isInteger(p.min_separation) ? `, b = ${p.min_separation}` : "";
      tail.push(`${p.mechanism}${b}`);
    } else if (p.mechanism === "gaussian") {
      tail.push("gaussian");
    }
    if (isNum(p.target_epsilon) && (p.epsilon === "inf" || p.epsilon >= p.target_epsilon)) {
      details.push("budget spent");
    }
    if (FTRL[p.mechanism]) details.push(FTRL[p.mechanism]);
    if (isNum(p.noise_multiplier)) details.push(`noise multiplier ${sig(p.noise_multiplier)}`);
    if (p.sampling === "fixed") details.push("fixed-size cohorts");
    else if (isNum(p.sampling_rate)) details.push(`Poisson sampling q = ${sig(p.sampling_rate)}`);
    if (Number.isInteger(p.steps)) details.push(`${p.steps} noised round${p.steps === 1 ? "" : "s"}`);
    return [[`epsilon ${eps}${budget}${tail.length ? " " : ""}`, tail], details.join(" · ")];
  }

  // The round's bounding (info["clip"]): the update-norm clip, then (detail) the cap on a phone's
  // sample weight n_k and FedAtt's attention cap; "none (--bound off)" for the undefended arm.
  // Under DP no exact count (clipped updates, capped weights): the guarantee does not cover them
  // (fedkey.federation.metrics_row.public_info), so an older export that recorded them does not show them.
  function boundingText(p) {
    const main = [];
    const details = [];
    const exact = !(p && p.dp);
    const c = p && p.clip;
    const a = p && p.adaptive_clip;
    if (c && c.mode === "off") {
      main.push("none (--bound off)");
    } else if (c) {
      const mode = c.mode === "dp" ? "DP" : c.mode || "norm";
      let t = `${mode} clip${c.scope === "layer" ? " per layer" : ""}`;
      if (c.mode === "dp" && a && isNum(a.quantile)) t += ` (adaptive, quantile ${sig(a.quantile)})`;
      if (isNum(c.norm)) t += `, S = ${sig(c.norm)}`;
      if (exact && Number.isInteger(c.clipped)) {
        t += Number.isInteger(c.updates) ? `, ${c.clipped} of ${c.updates} clipped` : `, ${c.clipped} clipped`;
      } else if (exact && isNum(c.clipped_fraction)) {
        t += `, ${Math.round(100 * c.clipped_fraction)}% clipped`;
      }
      main.push(t);
      if (exact && isNum(c.weight_cap)) {
        const k = c.capped_weights;
        const cap = Number.isInteger(c.weight_cap) ? String(c.weight_cap) : sig(c.weight_cap);
        details.push(`sample weights capped at ${cap}${k > 0 ? ` (${k} capped)` : ""}`);
      }
      if (isNum(c.attention_cap)) details.push(`attention ≤ ${sig(c.attention_cap)}`);
      if (a && isNum(a.unclipped_fraction_noisy)) {
        details.push(`noised share within the clip ${sig(a.unclipped_fraction_noisy)}`);
      }
    }
    const d = p && p.dp_clip;
    if (d && isNum(d.norm)) {
      let t = `DP clip, S = ${sig(d.norm)}`;
      if (exact && isNum(d.clipped_fraction)) t += `, ${Math.round(100 * d.clipped_fraction)}% clipped`;
      main.push(t);
    }
    return [main.join(" · "), details.join(" · ")];
  }

  function showPrivacy(p) {
    const show = (id, text) => {
      $(id).textContent = text;
      $(id).hidden = !text;
    };
    const [[main, tail], detail] = privacyText(p);
    const value = $("privacy");
    value.textContent = main;
    tail.forEach((part, i) => {
      if (i) value.append(" · ");
      const keep = document.createElement("span"); // "(delta 1e-5)" never breaks at its hyphen
      keep.className = "nowrap";
      keep.textContent = part;
      value.append(keep);
    });
    value.title = detail; // short screens hide the detail line
    show("privacy-detail", detail);
    const [bounding, boundingDetail] = boundingText(p);
    $("bounding").textContent = bounding;
    $("bounding").title = boundingDetail;
    $("bounding-row").hidden = !bounding;
    show("bounding-detail", boundingDetail);
  }

  // The corpora a model can learn from, as the page names them (else the name as recorded).
  const CORPORA = {
    demo: "the generated demo corpus",
    "nus-sms": "NUS SMS (real text messages)",
    "ubuntu-irc": "Ubuntu IRC (real #ubuntu chat)",
  };

  // Which round is served and why (the best on validation so far, or the latest round), and the
  // corpus the model learned from, from the export's "best_round" and "data" and the chart's rows.
  let served = null;

  function servedNote() {
    const m = served;
    if (!m || m.round === null || m.round === undefined) return "";
    const parts = [];
    const all = Array.from(rows.values());
    const last = all.length ? Math.max(...all.map((r) => r.round)) : m.round;
    const vals = all.filter((r) => isNum(r.val_ppl)).map((r) => r.val_ppl);
    const beaten = isNum(m.val_ppl) && vals.some((v) => v < m.val_ppl);
    const span = last > m.round ? ` of rounds 0–${last}` : " so far";
    if (m.best_round === m.round && !beaten) {
      parts.push(`serving round ${m.round}: the best on validation${span}`);
    } else if (Number.isInteger(m.best_round) && m.best_round !== m.round) {
      parts.push(`serving round ${m.round}, the latest (best on validation: round ${m.best_round})`);
    } else {
      parts.push(`serving round ${m.round}`);
    }
    if (m.data) parts.push(`learned from ${CORPORA[m.data] || m.data}`);
    return parts.join(" · ");
  }

  function showServed() {
    $("served-note").textContent = servedNote();
  }

  function showModel(m) {
    served = m;
    setRound(m.round);
    $("strategy").textContent = m.strategy || "–";
    showPrivacy(m.privacy);
    const ppl = m.perplexity ?? m.test_ppl ?? m.val_ppl;
    $("perplexity").textContent = fmt(ppl) + (m.int8 ? " · int8" : "");
    if (m.round !== null && m.round !== undefined && (m.val_ppl != null || m.test_ppl != null)) {
      const row = rows.get(m.round) || {};
      rows.set(m.round, {
        round: m.round,
        val_ppl: row.val_ppl ?? m.val_ppl,
        test_ppl: row.test_ppl ?? m.test_ppl,
      });
      drawChart();
    }
    showServed();
  }

  const rows = new Map(); // round -> {round, val_ppl, test_ppl}

  function addRows(list) {
    for (const r of list || []) {
      if (r && typeof r.round === "number") {
        rows.set(r.round, { round: r.round, val_ppl: r.val_ppl, test_ppl: r.test_ppl });
      }
    }
    drawChart();
    showServed();
  }

  const SVGNS = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    const e = document.createElementNS(SVGNS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function drawChart() {
    const svg = $("chart");
    if (!svg) return;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const W0 = 360;
    const H0 = 150;
    const pad = { l: 34, r: 8, t: 8, b: 18 };
    const data = Array.from(rows.values()).sort((a, b) => a.round - b.round);
    const vals = data.flatMap((d) => [d.val_ppl, d.test_ppl]).filter((v) => v > 0 && isFinite(v));
    if (!vals.length) {
      svg.appendChild(el("text", { x: W0 / 2, y: H0 / 2, "text-anchor": "middle" }, "no rounds yet"));
      return;
    }
    let lo = Math.min(...vals);
    let hi = Math.max(...vals);
    const log = hi / lo > 4;
    const f = log ? Math.log : (x) => x;
    if (hi === lo) {
      lo *= 0.9;
      hi *= 1.1;
    }
    const y0 = f(lo);
    const y1 = f(hi);
    // One round alone sits in the middle of the x axis.
    const r0 = data.length > 1 ? data[0].round : data[0].round - 1;
    const r1 = data.length > 1 ? data[data.length - 1].round : data[0].round + 1;
    const X = (r) => pad.l + ((r - r0) / (r1 - r0)) * (W0 - pad.l - pad.r);
    const Y = (v) => pad.t + (1 - (f(v) - y0) / (y1 - y0 || 1)) * (H0 - pad.t - pad.b);
    svg.appendChild(el("line", { class: "axis", x1: pad.l, y1: H0 - pad.b, x2: W0 - pad.r, y2: H0 - pad.b }));
    svg.appendChild(el("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: H0 - pad.b }));
    for (const v of [lo, log ? Math.sqrt(lo * hi) : (lo + hi) / 2, hi]) {
      svg.appendChild(el("text", { x: pad.l - 3, y: Y(v) + 3, "text-anchor": "end" }, fmt(v)));
    }
    const ticks = new Set([r0, r1, Math.round((r0 + r1) / 2)]);
    for (const r of ticks) {
      svg.appendChild(el("text", { x: X(r), y: H0 - 5, "text-anchor": "middle" }, String(r)));
    }
    if (state.round !== null && state.round !== undefined && state.round >= r0) {
      const x = X(state.round);
      svg.appendChild(el("line", { class: "served", x1: x, y1: pad.t, x2: x, y2: H0 - pad.b }));
    }
    for (const key of ["val_ppl", "test_ppl"]) {
      const pts = data.filter((d) => d[key] > 0 && isFinite(d[key]));
      const cls = key === "val_ppl" ? "val" : "test";
      if (pts.length > 1) {
        const dpath = pts.map((d, i) => `${i ? "L" : "M"}${X(d.round).toFixed(1)},${Y(d[key]).toFixed(1)}`);
        svg.appendChild(el("path", { class: `line ${cls}`, d: dpath.join(" ") }));
      }
      for (const d of pts) {
        svg.appendChild(el("circle", { class: `dot ${cls}`, cx: X(d.round), cy: Y(d[key]), r: 2.5 }));
      }
    }
  }

  async function refreshInfo() {
    try {
      const info = await (await fetch("/api/info", { cache: "no-store" })).json();
      state.info = info;
      const opt = modeSelect.querySelector('option[value="browser"]');
      opt.disabled = !info.browser_mode.available;
      opt.title = info.browser_mode.reason || "";
      if (!info.browser_mode.available) {
        opt.textContent = "on this device (unavailable)";
        $("mode").title = `browser mode unavailable: ${info.browser_mode.reason}`;
      }
      if (state.mode === "server") showModel(info);
      if (!info.suggestions) setStatus(info.error, true);
      else if (state.mode === "server" && state.serverReady) setStatus(serverStatus());
      return info;
    } catch (e) {
      setStatus(`cannot reach the keyboard server: ${e.message || e}`, true);
      return null;
    }
  }

  async function refreshMetrics() {
    try {
      const r = await fetch("/api/metrics", { cache: "no-store" });
      const body = await r.json();
      if (!r.ok) {
        $("chart-source").textContent = "(federation server unreachable)";
        return;
      }
      $("chart-source").textContent = body.source === "federation" ? "· live" : "· served models";
      addRows(body.rounds);
    } catch {
      /* the chart keeps what it has */
    }
  }

  let evBackoff = 500;

  function connectEvents() {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/events`;
    const es = new WebSocket(url);
    es.onopen = () => (evBackoff = 500);
    es.onmessage = async (ev) => {
      let e;
      try {
        e = JSON.parse(ev.data);
      } catch {
        return;
      }
      if (e.type === "round_aggregated") {
        addRows([e]);
      } else if (e.type === "model_loaded") {
        if (state.mode === "server") showModel(e);
        else addRows([e]);
        await refreshInfo();
        if (state.mode === "browser" && state.browserRound !== e.round) {
          try {
            const meta = await loadBrowserModel();
            showModel({ ...meta, ...(meta.metrics || {}) });
            changed(true);
          } catch (err) {
            setStatus(`could not load round ${e.round} in the browser: ${err.message || err}`, true);
          }
        } else if (state.mode === "server") {
          changed(true);
        }
      } else if (e.type === "upstream" && e.connected) {
        refreshMetrics();
      }
    };
    es.onclose = () => {
      setTimeout(connectEvents, evBackoff);
      evBackoff = Math.min(evBackoff * 2, 10000);
    };
  }

  // ---------------------------------------------------------------------------------------------
  buildKeyboard();
  render([]);
  drawChart();
  refreshInfo().then(() => refreshMetrics());
  connectSuggest();
  connectEvents();
  input.focus();
})();
