/* The page's model panel, as text and pictures: the privacy block, the bounding line, which round
 * is served and why, the served round against round 0, and the perplexity chart. Pure functions of
 * what the export and the federation server record (app.js puts them on the page).
 * window.FedkeyPanel.
 */
(function (root) {
  "use strict";

  /** A perplexity as the panel shows it ("–" when unknown). */
  function fmt(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return x >= 100 ? x.toFixed(0) : x.toFixed(1);
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

  // The corpora a model can learn from, as the page names them (else the name as recorded).
  const CORPORA = {
    demo: "the generated demo corpus",
    "nus-sms": "NUS SMS (real text messages)",
    "ubuntu-irc": "Ubuntu IRC (real #ubuntu chat)",
  };

  // Which round is served and why (the best on validation so far, or the latest round), and the
  // corpus the model learned from, from the export's "best_round" and "data" and the chart's rows.
  function servedNote(m, rows) {
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

  // The served round against round 0, the model the run started from (with --init, the base
  // pretrained on public chat), both as their metrics rows score them on the phones' held-out text:
  // test perplexity (else validation) and the suggestion bar's top-1 (bar_top1); the mixture's
  // (mix_*) when the keyboard mixes its n-gram in (`mixed`), as it suggests. [text, title], or
  // ["", ""] without a round-0 row or a number both rows hold. Nothing recorded says whether
  // round 0 was a pretrained base, so the line names it "round 0" (the title: the initial model).
  function baselineText(rows, round, mixed) {
    const first = rows.get(0);
    const now = rows.get(round);
    if (!Number.isInteger(round) || round <= 0 || !first || !now) return ["", ""];
    const both = (k) => isNum(first[k]) && isNum(now[k]);
    const mix = Boolean(mixed) && (both("mix_test_ppl") || both("mix_val_ppl"));
    const pre = mix ? "mix_" : "";
    const ppl = [`${pre}test_ppl`, `${pre}val_ppl`].find(both);
    const top = `${pre}bar_top1`;
    const parts = [];
    if (ppl) parts.push(`perplexity ${fmt(first[ppl])} → ${fmt(now[ppl])}`);
    if (both(top)) parts.push(`top-1 ${first[top].toFixed(3)} → ${now[top].toFixed(3)}`);
    if (!parts.length) return ["", ""];
    const what = [];
    if (ppl) what.push(`${ppl.endsWith("test_ppl") ? "test" : "validation"} perplexity`);
    if (both(top)) what.push("the suggestion bar's top-1");
    const title =
      `round 0 (the initial model, before any phone trained) against round ${round} (served): ` +
      `${what.join(" and ")} on the phones' held-out text` +
      (mix ? ", of the model mixed with the keyboard's n-gram, as it suggests" : "");
    return [`vs round 0${mix ? " (with the n-gram)" : ""}: ${parts.join(", ")}`, title];
  }

  const SVGNS = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    const e = document.createElementNS(SVGNS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  /** The perplexity chart of `rows` (round -> {round, val_ppl, test_ppl}) in `svg`, the served
   * `round` marked. */
  function drawChart(svg, rows, round) {
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
    if (round !== null && round !== undefined && round >= r0) {
      const x = X(round);
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

  root.FedkeyPanel = { fmt, privacyText, boundingText, servedNote, baselineText, drawChart };
})(window);
