/* memopd report: a paged, sortable, filterable episode index; episode details are parsed and
   built only when expanded; training curves as inline SVG.
   Episode text only ever reaches the page through textContent / setAttribute, never as markup. */
"use strict";
(function () {
  const INDEX = JSON.parse(document.getElementById("memopd-index").textContent);
  const ROWS = INDEX.rows;
  const PAGE = INDEX.options.page_size;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#6e7781"];
  const hasSteps = INDEX.steps.length > 0;
  const hasKL = ROWS.some(r => r.kl !== null);

  // [row key, header, decimals (null: text column, undefined: integer)]
  const COLUMNS = [
    ["i", "#", undefined], ["task", "task", null], ["sample", "sample", null],
    hasSteps && ["step", "step", undefined],
    ["f1", "F1", 2], ["em", "EM", 2], ["reward", "reward", 2], ["calls", "calls", undefined],
    ["ctx", "peak ctx", undefined], ["mem", "mem tok", undefined],
    hasKL && ["kl", "KL", 3],
    ["pred", "prediction", null], ["gold", "gold", null],
  ].filter(Boolean);

  const state = { sort: "i", desc: false, query: "", failures: INDEX.options.failures_only,
                  step: "", page: 0, open: new Set() };
  const built = new Map();  // episode index -> its detail <tr>, built on first expand

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, props, ...kids) {
    const e = document.createElement(tag);
    setProps(e, props);
    for (const kid of kids.flat()) if (kid !== null && kid !== undefined && kid !== false) e.append(kid);
    return e;
  }

  function svg(tag, props, ...kids) {
    const e = document.createElementNS(SVG_NS, tag);
    setProps(e, props);
    for (const kid of kids.flat()) if (kid !== null && kid !== undefined && kid !== false) e.append(kid);
    return e;
  }

  function setProps(e, props) {
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
  }

  function fmt(v, digits) {  // whole numbers as integers: 3, not 3.0 or 3.0000
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return v.toFixed(digits === undefined ? 3 : digits);
  }

  function tick(v) {  // short axis label
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a >= 1e6 || a < 1e-3) return v.toExponential(1);
    return String(a >= 1e3 ? Math.round(v) : Number(v.toPrecision(3)));
  }

  function f1Class(v) {
    if (v === null) return null;
    return v >= 1 ? "f1-ok" : v > 0 ? "f1-mid" : "f1-bad";
  }

  function klColor(v) {
    if (v === null || INDEX.kl_scale === null) return "transparent";
    const alpha = Math.min(1, Math.max(0, v / INDEX.kl_scale)) * 0.85;
    return `rgba(207,34,46,${alpha.toFixed(3)})`;
  }

  // ------------------------------------------------------------------ charts

  /* series: [{name, points: [[x, y or null], ...]}]; a null y breaks the line. */
  function lineChart(title, series, opts) {
    opts = opts || {};
    const W = opts.width || 290, H = opts.height || 200, L = 48, R = 10, T = 22, B = 40;
    const pts = series.flatMap(s => s.points.filter(p => p[1] !== null && Number.isFinite(p[1])));
    const root = svg("svg", { class: "chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
                              "aria-label": title, "data-title": title });
    root.append(svg("text", { class: "title", x: 8, y: 15, text: title }));
    if (!pts.length) {
      root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", text: "no data" }));
      return root;
    }
    let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
    let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
    if (opts.zero) y0 = Math.min(0, y0);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#d0d7de" }),
                svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#d0d7de" }));
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      root.append(svg("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end", text: tick(y) }));
    }
    root.append(svg("text", { x: L, y: H - B + 12, text: fmt(x0) }),
                svg("text", { x: W - R, y: H - B + 12, "text-anchor": "end", text: fmt(x1) }),
                svg("text", { x: (L + W - R) / 2, y: H - B + 12, "text-anchor": "middle", text: opts.xlabel || "step" }));
    const legend = { x: L, y: H - 14 };
    series.forEach((s, k) => {
      const color = s.color || PALETTE[k % PALETTE.length];
      let run = [];
      const flush = () => {
        if (run.length > 1) root.append(svg("polyline", { points: run.join(" "), fill: "none", stroke: color,
                                                          "stroke-width": 1.6, "data-series": s.name }));
        run = [];
      };
      for (const [x, y] of s.points) {
        if (y === null || !Number.isFinite(y)) { flush(); continue; }
        run.push(`${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
        if (s.points.length <= 60) {
          root.append(svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 2.5, fill: color },
                          svg("title", { text: `${s.name} @ ${fmt(x)}: ${fmt(y, 4)}` })));
        }
      }
      flush();
      root.append(svg("rect", { x: legend.x, y: legend.y - 7, width: 10, height: 3, fill: color }),
                  svg("text", { x: legend.x + 13, y: legend.y - 3, text: s.name }));
      legend.x += 22 + 5.5 * s.name.length;  // next entry; wrap when the row is full
      if (legend.x > W - 60) { legend.x = L; legend.y += 11; }
    });
    return root;
  }

  // ------------------------------------------------------------------ header, run section

  function renderHeader() {
    const m = INDEX.means;
    document.getElementById("top").append(
      el("h1", { text: INDEX.title }),
      el("div", { class: "muted mono", text: `${INDEX.kind}: ${INDEX.source}` }),
      ...(INDEX.heldout ? [el("div", { class: "stats" }, el("b", { text: INDEX.heldout }))] : []),
      el("div", { class: "stats" },
        el("span", { text: INDEX.kind === "run" ? `${ROWS.length} episodes (training samples of the logged steps)` : `${ROWS.length} episodes` }),
        el("span", { text: `${INDEX.failures} failures (F1 < 1)` }),
        ["em", "f1", "sub_em"].map(k => el("span", { text: `mean ${k} ${fmt(m[k])}` })),
        el("span", { class: "muted", text: INDEX.tokenizer ? "decoded with a tokenizer" : "no tokenizer: recorded texts and token counts" })));
    if (INDEX.summary) {
      const rows = Object.entries(INDEX.summary).map(([k, v]) =>
        el("tr", {}, el("th", { text: k }), el("td", { class: "mono", text: typeof v === "object" ? JSON.stringify(v) : fmt(v, 4) })));
      document.getElementById("top").append(el("h2", { text: "summary.json" }), el("table", { class: "kv" }, rows));
    }
    if (INDEX.errors.length) {
      const shown = INDEX.errors.slice(0, 50).map(e => el("li", { text: e }));
      if (INDEX.errors.length > 50) shown.push(el("li", { text: `... ${INDEX.errors.length - 50} more` }));
      document.getElementById("warnings").append(el("div", { class: "warn" },
        el("b", { text: `${INDEX.errors.length} line(s) could not be read and were skipped:` }), el("ul", {}, shown)));
    }
  }

  function renderRun() {
    const section = document.getElementById("run");
    const rows = INDEX.metrics;
    if (rows.length) {
      const seriesFor = key => ({ name: key, points: rows.filter(r => key in r).map(r => [r.step, r[key]]) });
      const used = new Set(["step"]);
      const charts = INDEX.panels.map(p => {
        p.keys.forEach(k => used.add(k));
        return lineChart(p.title, p.keys.filter(k => rows.some(r => r[k] !== undefined && r[k] !== null)).map(seriesFor));
      });
      const others = [...new Set(rows.flatMap(r => Object.keys(r)))].filter(k => !used.has(k)).sort();
      section.append(el("h2", { text: "Training curves" }), el("div", { class: "charts", id: "curves" }, charts));
      if (others.length) {
        section.append(el("details", {}, el("summary", { text: `${others.length} more logged metrics` }),
          el("div", { class: "charts" }, others.map(k => lineChart(k, [seriesFor(k)], { width: 260, height: 160 })))));
      }
    }
    if (hasSteps) {
      section.append(el("h2", { text: "Sample episodes per logged step" }),
        el("div", { class: "steps" }, INDEX.steps.map(s =>
          el("a", { href: `#step=${s.step}`, text: `step ${s.step} (${s.n} episodes, F1 ${fmt(s.f1, 2)})` }))));
    }
    if (INDEX.config !== null) {
      section.append(el("details", {}, el("summary", { text: "config.toml" }), el("pre", { text: INDEX.config })));
    }
  }

  // ------------------------------------------------------------------ index

  function renderHead() {
    const tr = document.querySelector("#episodes thead tr");
    tr.replaceChildren(...COLUMNS.map(([key, label, digits]) => {
      const num = digits !== null;
      const cls = [num ? "num" : "", state.sort === key ? "sorted" : "", state.sort === key && state.desc ? "desc" : ""];
      return el("th", { class: cls.join(" ").trim() || null, "data-key": key, title: "sort", text: label,
                        onclick: () => sortBy(key) });
    }));
  }

  function sortBy(key) {
    if (state.sort === key) state.desc = !state.desc;
    else { state.sort = key; state.desc = ["f1", "em", "reward", "kl", "calls", "ctx", "mem"].includes(key); }
    state.page = 0;
    renderHead();
    renderIndex();
  }

  function compare(a, b) {
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b));
  }

  function visibleRows() {
    const words = state.query.toLowerCase().split(/\s+/).filter(Boolean);
    const rows = ROWS.filter(r => (!state.failures || r.fail)
      && (state.step === "" || String(r.step) === state.step)
      && words.every(w => r.text.includes(w)));
    const key = state.sort, dir = state.desc ? -1 : 1;
    rows.sort((a, b) => {
      const na = a[key] === null, nb = b[key] === null;  // missing values sort last either way
      if (na || nb) return (na - nb) || a.i - b.i;
      return compare(a[key], b[key]) * dir || a.i - b.i;
    });
    return rows;
  }

  function renderIndex() {
    const rows = visibleRows();
    const pages = Math.max(1, Math.ceil(rows.length / PAGE));
    state.page = Math.min(Math.max(0, state.page), pages - 1);
    const start = state.page * PAGE, shown = rows.slice(start, start + PAGE);
    const body = document.querySelector("#episodes tbody");
    body.replaceChildren();
    for (const r of shown) {
      body.append(indexRow(r));
      if (state.open.has(r.i)) body.append(detailRow(r.i));
    }
    const count = document.getElementById("count");
    count.textContent = rows.length === ROWS.length ? `${rows.length} episodes`
      : `${rows.length} of ${ROWS.length} episodes`;
    count.dataset.shown = rows.length;
    count.dataset.total = ROWS.length;
    document.getElementById("page").textContent = rows.length
      ? `${start + 1}–${start + shown.length} · page ${state.page + 1} / ${pages}` : "nothing matches";
    document.getElementById("prev").disabled = state.page === 0;
    document.getElementById("next").disabled = state.page >= pages - 1;
  }

  function indexRow(r) {
    const cells = COLUMNS.map(([key, , digits]) => {
      const v = r[key], num = digits !== null;
      const cls = [num ? "num" : "text", key === "f1" ? f1Class(v) : ""].join(" ").trim();
      const text = num ? fmt(v, digits) : (v === null ? "–" : String(v));
      return el("td", { class: cls, title: num ? null : text, text });
    });
    return el("tr", { class: state.open.has(r.i) ? "row open" : "row", "data-i": r.i,
                      onclick: () => toggle(r.i) }, cells);
  }

  function toggle(i) {
    if (state.open.has(i)) state.open.delete(i); else state.open.add(i);
    renderIndex();
  }

  function detailRow(i) {
    if (!built.has(i)) {
      const d = JSON.parse(document.getElementById(`ep-${i}`).textContent);
      built.set(i, el("tr", { class: "detail", "data-i": i }, el("td", { colspan: COLUMNS.length }, renderEpisode(d))));
    }
    return built.get(i);
  }

  // ------------------------------------------------------------------ one episode

  function renderEpisode(d) {
    const facts = [`task ${d.task}`, `sample ${d.sample}`, d.step !== null && `step ${d.step}`,
                   d.seed !== null && `seed ${d.seed}`, d.group !== null && `group ${d.group}`,
                   `reward ${fmt(d.reward, 4)}`].filter(Boolean).join(" · ");
    return el("div", { class: "episode", "data-episode": d.i },
      el("h3", { text: `episode ${d.id}` }), el("div", { class: "muted", text: facts }),
      el("div", { class: "episode-head" }, answerBox(d), episodeCharts(d)),
      d.prefix.text !== null || d.question
        ? el("details", { class: "prefix" }, el("summary", { text: `shared prefix · ${d.prefix.tokens} tokens` }),
            el("pre", { text: d.prefix.text !== null ? d.prefix.text : `question: ${d.question}\n(pass --tokenizer to decode the full prefix)` }))
        : null,
      el("h3", { text: `${d.calls.length} calls` }),
      d.calls.map(c => renderCard(c, d)),
      d.meta ? el("details", {}, el("summary", { text: "episode meta" }), el("pre", { text: d.meta })) : null);
  }

  function answerBox(d) {
    const metrics = Object.entries(d.metrics).map(([k, v]) => `${k} ${fmt(v, 3)}`).join(" · ");
    const head = ["gold", "normalised gold", "normalised prediction", "EM", "F1", "sub-EM", "shared tokens"];
    const best = d.breakdown.reduce((b, r, k) => (b === -1 || r.f1 > d.breakdown[b].f1 ? k : b), -1);
    const table = d.breakdown.length ? el("table", { class: "breakdown" },
      el("tr", {}, head.map(h => el("th", { text: h }))),
      d.breakdown.map((r, k) => el("tr", { class: k === best ? "best" : null },
        el("td", { text: r.gold }), el("td", { class: "mono", text: r.gold_norm }),
        el("td", { class: "mono", text: r.pred_norm }), el("td", { class: f1Class(r.em), text: fmt(r.em, 2) }),
        el("td", { class: f1Class(r.f1), text: fmt(r.f1, 2) }), el("td", { text: fmt(r.sub_em, 2) }),
        el("td", { class: "mono", text: r.common.join(" ") || "–" })))) : null;
    return el("div", { class: "answer-box" },
      el("div", { class: "label", text: "question" }), el("div", { text: d.question || "–" }),
      el("div", { class: "label", text: "gold" }), el("div", { class: "gold", text: d.answers.join(" | ") || "–" }),
      el("div", { class: "label", text: "prediction" }), el("div", { class: "prediction", text: d.prediction || "–" }),
      el("div", { class: "label", text: "recorded scores" }), el("div", { class: "mono", text: metrics || "–" }),
      d.perturbations && d.perturbations.length ? el("div", { class: "label", text: "memory perturbed" }) : null,
      d.perturbations && d.perturbations.length
        ? el("div", { class: "mono perturbed", text: d.perturbations.join("\n") }) : null,
      table && el("div", { class: "label", text: "scorer breakdown (SQuAD normalisation, per gold answer)" }), table);
  }

  function episodeCharts(d) {
    const calls = d.calls.map((c, k) => [k, c]);
    const received = ([, c]) => {
      const seg = c.segments.find(s => s.name === "memory");
      return seg && seg.tokens !== null ? seg.tokens : null;
    };
    const sizes = [
      { name: "memory written", color: "#0969da",
        points: calls.map(([k, c]) => [k, c.role === "memory" ? c.response_tokens : null]) },
      { name: "memory received", color: "#1a7f37", points: calls.map(e => [e[0], received(e)]) },
      { name: "prompt", color: "#6e7781", points: calls.map(([k, c]) => [k, c.prompt_tokens]) },
    ].filter(s => s.points.some(p => p[1] !== null));
    const charts = [lineChart("memory and context (tokens)", sizes, { width: 300, height: 170, xlabel: "call", zero: true })];
    if (d.calls.some(c => c.kl_stats)) {
      charts.push(lineChart("teacher KL per call", [
        { name: "mean", color: "#cf222e", points: calls.map(([k, c]) => [k, c.kl_stats ? c.kl_stats.mean : null]) },
        { name: "max", color: "#bc4c00", points: calls.map(([k, c]) => [k, c.kl_stats ? c.kl_stats.max : null]) },
      ], { width: 300, height: 170, xlabel: "call", zero: true }));
    }
    const roles = Object.entries(d.kl_by_role).map(([role, s]) =>
      el("div", { class: "mono", text: `KL on ${role} calls: mean ${fmt(s.mean)} · max ${fmt(s.max)} · ${s.n} tokens` }));
    return el("div", {}, el("div", { class: "charts" }, charts), roles,
      roles.length ? el("div", { class: "muted" }, "KL 0", el("span", { class: "legend-swatch" }),
                        `≥ ${fmt(INDEX.kl_scale)} (95th percentile of this report)`) : null);
  }

  function renderCard(c, d) {
    const head = el("div", { class: "card-head" },
      el("span", { class: `pill ${c.role}`, text: c.role }), el("b", { text: `turn ${c.turn}` }),
      el("span", { text: `prompt ${c.prompt_tokens} tok (prefix ${c.prefix_tokens} + state ${c.prompt_tokens - c.prefix_tokens})` }),
      el("span", { text: `response ${c.response_tokens} tok · ${c.finish_reason}` }),
      c.logp_mean !== null && el("span", { text: `mean logp ${fmt(c.logp_mean)}` }),
      c.kl_stats && el("span", { class: "kl-summary", text: `KL mean ${fmt(c.kl_stats.mean)} · max ${fmt(c.kl_stats.max)}` }),
      c.teacher_mode && el("span", { class: "muted", text: `teacher: ${c.teacher_mode}` }),
      el("span", { class: "muted", text: `policy v${c.policy_version}` }),
      Object.keys(c.timing).length > 0 && el("span", { class: "muted",
        text: Object.entries(c.timing).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ") }),
      c.sampling && el("span", { class: "muted mono", title: "sampling", text: c.sampling }));
    const prefix = el("details", { class: "prefix" }, el("summary", { text: `shared prefix (${c.prefix_tokens} tokens)` }));
    prefix.addEventListener("toggle", () => {  // filled on first open: the text is the same in every card
      if (prefix.open && prefix.children.length === 1) {
        prefix.append(el("pre", { text: d.prefix.text !== null ? d.prefix.text : "not decoded (pass --tokenizer)" }));
      }
    });
    const parts = [head, prefix];
    for (const seg of c.segments) {
      const label = seg.name === "memory" ? "memory received" : seg.name;
      const notes = [seg.tokens !== null && `${seg.tokens} tokens`,
                     seg.source && seg.source !== "recorded" && seg.source].filter(Boolean).join(", ");
      parts.push(el("div", { class: "label", text: notes ? `${label} (${notes})` : label }),
                 seg.text !== null ? el("pre", { class: `segment ${seg.name}`, text: seg.text || "(empty)" })
                   : el("div", { class: "muted", text: "not recorded; pass --tokenizer to decode" }));
    }
    if (c.state !== null) {
      parts.push(el("div", { class: "label", text: "state (decoded prompt after the prefix)" }), el("pre", { class: "state", text: c.state }));
    } else if (!c.segments.length) {
      parts.push(el("div", { class: "muted", text: `${c.prompt_tokens - c.prefix_tokens} state tokens; `
        + "no parts recorded, pass --tokenizer to decode" }));
    }
    parts.push(el("div", { class: "label", text: "sampled action" }), actionView(c));
    for (const w of c.warnings) parts.push(el("div", { class: "warn", text: w }));
    if (c.meta) parts.push(el("details", {}, el("summary", { text: "meta" }), el("pre", { text: c.meta })));
    return el("div", { class: `card ${c.role}`, "data-turn": c.turn }, parts);
  }

  function actionView(c) {
    if (c.kl && c.pieces) {
      return el("div", { class: "action kl" }, c.pieces.map((p, k) => el("span", {
        class: "tok", style: `background:${klColor(c.kl[k])}`, text: p,
        title: `token ${k} · KL ${fmt(c.kl[k], 4)} · logp ${fmt(c.logprobs[k], 3)}` })));
    }
    const text = c.action || `(${c.response_tokens} tokens; no response_text recorded, pass --tokenizer to decode)`;
    const box = el("div", { class: "action", text });
    if (!c.kl) return box;
    // no tokenizer: the text cannot be split into tokens, so one coloured cell per token
    return el("div", {}, box, el("div", { class: "klstrip", title: "teacher KL per response token" },
      c.kl.map((v, k) => el("span", { class: "klcell", style: `background:${klColor(v)}`,
                                       title: `token ${k} · KL ${fmt(v, 4)} · logp ${fmt(c.logprobs[k], 3)}` }))));
  }

  // ------------------------------------------------------------------ navigation

  function openEpisode(i) {
    if (!(i >= 0 && i < ROWS.length)) return;
    let pos = visibleRows().findIndex(r => r.i === i);
    if (pos < 0) {  // hidden by a filter: clear the filters so it can be shown
      Object.assign(state, { query: "", failures: false, step: "" });
      syncControls();
      pos = visibleRows().findIndex(r => r.i === i);
    }
    state.page = Math.floor(pos / PAGE);
    state.open.add(i);
    renderIndex();
    const row = document.querySelector(`#episodes tr.row[data-i="${i}"]`);
    if (row) row.scrollIntoView({ block: "start" });
  }

  function onHash() {
    const m = /^#(ep|step)=(-?\d+)$/.exec(location.hash);
    if (!m) return;
    if (m[1] === "ep") openEpisode(Number(m[2]));
    else { state.step = m[2]; state.page = 0; syncControls(); renderIndex(); }
  }

  function syncControls() {
    document.getElementById("search").value = state.query;
    document.getElementById("failures").checked = state.failures;
    document.getElementById("step").value = state.step;
  }

  function setupControls() {
    const step = document.getElementById("step");
    if (hasSteps) {
      step.hidden = false;
      step.append(el("option", { value: "", text: "all steps" }),
                  ...INDEX.steps.map(s => el("option", { value: String(s.step), text: `step ${s.step}` })));
    }
    document.getElementById("search").addEventListener("input", e => { state.query = e.target.value; state.page = 0; renderIndex(); });
    document.getElementById("failures").addEventListener("change", e => { state.failures = e.target.checked; state.page = 0; renderIndex(); });
    step.addEventListener("change", e => { state.step = e.target.value; state.page = 0; renderIndex(); });
    document.getElementById("prev").addEventListener("click", () => { state.page -= 1; renderIndex(); });
    document.getElementById("next").addEventListener("click", () => { state.page += 1; renderIndex(); });
    window.addEventListener("hashchange", onHash);
    syncControls();
  }

  renderHeader();
  renderRun();
  setupControls();
  renderHead();
  renderIndex();
  if (location.hash) onHash();
  else if (INDEX.options.open_episode !== null) openEpisode(INDEX.options.open_episode);
})();
