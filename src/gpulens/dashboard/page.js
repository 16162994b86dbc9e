// gpulens live dashboard: the page's state, its data and its sections (served beside page.html);
// fed by the server-sent events of /events; the charts are chart.js's.
"use strict";
(function () {
  const COLORS = ["#2f5fd0", "#d6452f", "#1f9d55", "#e08a00", "#8a4fd0", "#7a5a3a",
    "#d04f9a", "#1aa3b8", "#6b7280", "#a3a11a"];
  const RANGES = [["5 min", 300], ["15 min", 900], ["1 h", 3600], ["6 h", 21600],
    ["24 h", 86400], ["whole run", Infinity]];
  const SECTIONS = [["overview", "At a glance"], ["training", "Training"],
    ["activity", "GPU activity"], ["memory", "Memory"], ["power", "Power and energy"],
    ["thermal", "Temperature, clocks, throttling"], ["host", "Host"], ["other", "Other keys"]];
  // Chart specs, in page order.  key: one series; gpu: a per-GPU suffix (every GPU on the
  // chart); ref: a per-GPU suffix drawn dashed as a limit; unless / onlyIf: shown only
  // without / with that per-GPU suffix.
  const SPECS = [
    {id: "loss", sec: "overview", title: "Loss", key: "train/loss"},
    {id: "sm", sec: "overview", title: "SM active", unit: "%", gpu: "sm_active_pct", pct: true},
    {id: "util0", sec: "overview", title: "GPU utilization (NVML)", unit: "%", gpu: "util_pct",
      pct: true, unless: "sm_active_pct"},
    {id: "mem", sec: "overview", title: "Memory used", unit: "GB", gpu: "mem_used_gb",
      zero: true, total: "mem_total_gb"},
    {id: "power", sec: "overview", title: "Power", unit: "W", gpu: "power_w", zero: true,
      ref: "power_limit_w"},
    {id: "mfu", sec: "overview", title: "MFU", unit: "%", key: "perf/mfu_pct", zero: true},
    {id: "tps", sec: "overview", title: "Throughput", unit: "tokens/s",
      key: "perf/tokens_per_s", zero: true},
    {id: "sps", sec: "overview", title: "Throughput", unit: "samples/s",
      key: "perf/samples_per_s", zero: true},
    {id: "lr", sec: "training", title: "Learning rate", key: "train/learning_rate"},
    {id: "gn", sec: "training", title: "Gradient norm", key: "train/grad_norm"},
    {id: "st", sec: "training", title: "Step time", unit: "s", key: "perf/step_time_s",
      zero: true},
    {id: "dw", sec: "training", title: "Waiting for data", unit: "% of step",
      key: "perf/data_wait_pct", pct: true},
    {id: "tflops", sec: "training", title: "Achieved", unit: "TFLOP/s per GPU",
      key: "perf/tflops", zero: true},
    {id: "tensor", sec: "activity", title: "Tensor cores active", unit: "%",
      gpu: "tensor_active_pct", pct: true},
    {id: "util", sec: "activity", title: "GPU utilization (NVML)", unit: "%", gpu: "util_pct",
      pct: true, onlyIf: "sm_active_pct"},
    {id: "occ", sec: "activity", title: "SM occupancy", unit: "%", gpu: "sm_occupancy_pct",
      pct: true},
    {id: "dram", sec: "activity", title: "DRAM bandwidth", unit: "%", gpu: "dram_bw_pct",
      pct: true},
    {id: "memp", sec: "memory", title: "Memory used", unit: "% of total", gpu: "mem_pct",
      pct: true},
    {id: "talloc", sec: "memory", title: "Torch allocated", unit: "GB",
      gpu: "torch_allocated_gb", zero: true},
    {id: "tpeak", sec: "memory", title: "Torch peak", unit: "GB", gpu: "torch_peak_gb",
      zero: true},
    {id: "eps", sec: "power", title: "Energy per step", unit: "J (all GPUs)",
      key: "perf/energy_per_step_j", zero: true},
    {id: "energy", sec: "power", title: "Energy per row", unit: "J", gpu: "energy_j",
      zero: true},
    {id: "tpj", sec: "power", title: "Energy efficiency", unit: "tokens/J",
      key: "perf/tokens_per_j", zero: true},
    {id: "temp", sec: "thermal", title: "Temperature", unit: "°C", gpu: "temp_c"},
    {id: "clock", sec: "thermal", title: "SM clock", unit: "MHz", gpu: "sm_clock_mhz",
      zero: true},
    {id: "thr", sec: "thermal", title: "Clocks held down", unit: "% of row",
      gpu: "throttle_pct", pct: true},
    {id: "thrp", sec: "thermal", title: "Held down by the power cap", unit: "% of row",
      gpu: "throttle_power_pct", pct: true},
    {id: "thrt", sec: "thermal", title: "Held down by temperature", unit: "% of row",
      gpu: "throttle_thermal_pct", pct: true},
    {id: "cpu", sec: "host", title: "Host CPU", unit: "%", key: "host/cpu_pct", pct: true},
    {id: "ram", sec: "host", title: "Host memory used", unit: "GB", key: "host/ram_used_gb",
      zero: true},
  ];
  // Keys never charted on their own: the axes, aggregates (every GPU is drawn), peaks and
  // limits (drawn with their metric), alert flags (in the advice panel).
  const HIDDEN = [/^train\/global_step$/, /^record\/elapsed_s$/, /^gpu\/all\//, /^alerts\//,
    /^gpu\/\d+\/samples$/, /^perf\/steps$/, /^gpu\/\d+\/[a-z0-9_]+_max$/,
    /^gpu\/\d+\/power_limit_w$/];
  const PER = /^(gpu|rank)\/(\d+)\/(.+)$/;

  const S = {run: null, title: "gpulens", ctx: {}, keys: [], col: new Map(), rows: [],
    events: [], maxRows: 8192, range: Infinity, xcol: -1, xmode: "step", charts: new Map(),
    ended: false, lastRowAt: 0, drawn: 0, errors: [], firstDataMs: null};
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  const {fmt, ticks, tickFormat, clock, timeOfDay} = window.gpulensChart;

  // ---- keys and rows ---------------------------------------------------------------------
  function addKeys(keys) {
    for (const k of keys) {
      if (S.col.has(k)) continue;
      S.col.set(k, S.keys.length);
      S.keys.push(k);
    }
    const e = S.col.get("record/elapsed_s"), g = S.col.get("train/global_step");
    S.xcol = e !== undefined ? e : g !== undefined ? g : -1;
    S.xmode = e !== undefined ? "elapsed" : "step";
    $("xinfo").textContent = "x-axis: " + (S.xmode === "elapsed" ? "time since the start "
      + "(m:ss)" : "training step");
    layout();
  }
  function X(r) {
    if (S.xcol >= 0) {
      const v = r[2 + S.xcol];
      if (v !== null && v !== undefined) return v;
      if (S.xmode === "elapsed") return null;
    }
    return r[0];
  }
  function addRows(rows) {
    for (const r of rows) S.rows.push(r);
    if (S.rows.length > S.maxRows) {  // the server's rule: thin the older half
      const half = S.rows.length >> 1;
      const kept = [];
      for (let i = 0; i < half; i += 2) kept.push(S.rows[i]);
      S.rows = kept.concat(S.rows.slice(half));
    }
    S.lastRowAt = Date.now();
    schedule();
  }
  let xMemo = null;
  function xRange(i0) {
    const last = S.rows[S.rows.length - 1];
    const key = [i0, S.rows.length, last && last[0], last && last[1], S.xcol, S.run].join(":");
    if (xMemo && xMemo[0] === key) return xMemo[1];
    let lo = Infinity, hi = -Infinity;
    for (let i = i0; i < S.rows.length; i++) {
      const x = X(S.rows[i]);
      if (x === null) continue;
      if (x < lo) lo = x;
      if (x > hi) hi = x;
    }
    xMemo = [key, [lo, hi]];
    return [lo, hi];
  }
  function firstVisible() {
    if (!S.rows.length || S.range === Infinity) return 0;
    const tmin = S.rows[S.rows.length - 1][1] - S.range;
    let lo = 0, hi = S.rows.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (S.rows[mid][1] < tmin) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // ---- layout: which charts exist --------------------------------------------------------
  function gpuCols(suffix, kind) {
    const out = [];
    for (const k of S.keys) {
      const m = PER.exec(k);
      if (m && m[1] === (kind || "gpu") && m[3] === suffix) out.push([+m[2], S.col.get(k)]);
    }
    return out.sort((a, b) => a[0] - b[0]);
  }
  function hasSuffix(suffix) { return gpuCols(suffix).length > 0; }
  function gpuName(i) {
    const g = (S.ctx.gpus || []).find((x) => x.index === i);
    return g ? g.name : "";
  }
  function seriesOf(spec) {
    if (spec.key !== undefined) {
      const c = S.col.get(spec.key);
      return c === undefined ? [] : [{label: spec.key, col: c, color: COLORS[0]}];
    }
    const kind = spec.kind || "gpu";
    const word = kind === "gpu" ? "GPU " : "rank ";
    return gpuCols(spec.gpu, kind).map(([i, c]) => ({label: word + i, col: c,
      color: COLORS[i % COLORS.length], gpu: i, name: kind === "gpu" ? gpuName(i) : ""}));
  }
  function refsOf(spec) {
    const out = [];
    if (spec.ref) for (const [i, c] of gpuCols(spec.ref)) out.push({gpu: i, col: c});
    return out;
  }
  function claimed() {
    const used = new Set();
    for (const s of SPECS) {
      if (s.key !== undefined) used.add(s.key);
      if (s.gpu) for (const k of S.keys) {
        const m = PER.exec(k);
        if (m && m[1] === "gpu" && m[3] === s.gpu) used.add(k);
      }
    }
    return used;
  }
  function dynamicSpecs() {
    const used = claimed(), out = [], per = new Map();
    for (const k of S.keys) {
      if (used.has(k) || HIDDEN.some((re) => re.test(k))) continue;
      const m = PER.exec(k);
      if (m) {
        const id = "x:" + m[1] + ":" + m[3];
        if (!per.has(id)) {
          per.set(id, true);
          out.push({id: id, sec: "other", title: m[1] + "/*/" + m[3], gpu: m[3], kind: m[1]});
        }
      } else {
        out.push({id: "x:" + k, sec: "other", title: k, key: k});
      }
    }
    return out;
  }
  function wanted() {
    const out = [];
    for (const s of SPECS) {
      if (s.unless && hasSuffix(s.unless)) continue;
      if (s.onlyIf && !hasSuffix(s.onlyIf)) continue;
      if (seriesOf(s).length) out.push(s);
    }
    return out.concat(dynamicSpecs());
  }
  function layout() {
    const specs = wanted();
    const ids = specs.map((s) => s.id).join("|");
    if (ids === S.layoutIds) {
      for (const c of S.charts.values()) c.refresh();
      return;
    }
    S.layoutIds = ids;
    const root = $("sections");
    root.textContent = "";
    const keep = new Map();
    for (const [id, title] of SECTIONS) {
      const mine = specs.filter((s) => s.sec === id);
      if (!mine.length) continue;
      const sec = el("section");
      sec.id = "sec-" + id;
      sec.appendChild(el("h2", "", title));
      const grid = el("div", "grid");
      for (const s of mine) {
        const c = S.charts.get(s.id) || new Chart(s);
        c.spec = s;
        c.refresh();
        grid.appendChild(c.box);
        keep.set(s.id, c);
      }
      sec.appendChild(grid);
      root.appendChild(sec);
    }
    S.charts = keep;
    schedule();
  }

  // ---- a chart (chart.js) ----------------------------------------------------------------
  const Chart = window.gpulensChart.makeChart(
    {S, X, xRange, firstVisible, seriesOf, refsOf, el, COLORS});

  // ---- drawing schedule ------------------------------------------------------------------
  let timer = null, lastDraw = 0;
  function schedule() {
    if (timer !== null) return;
    const wait = Math.max(0, 120 - (performance.now() - lastDraw));
    timer = setTimeout(drawAll, wait);
  }
  function drawAll() {
    timer = null;
    lastDraw = performance.now();
    for (const c of S.charts.values()) {
      try { c.draw(); } catch (err) { report(err); }
    }
    const last = S.rows[S.rows.length - 1];
    document.body.dataset.rows = String(S.rows.length);
    document.body.dataset.lastStep = last ? String(last[0]) : "";
    // ms from the page's opening (navigation start) to its first charts with data
    if (last && S.firstDataMs === null) S.firstDataMs = Math.round(performance.now());
    S.drawn++;
    status();
  }
  function report(err) {
    S.errors.push(String(err && err.stack || err));
    if (S.errors.length > 20) S.errors.shift();
    console.error(err);
  }

  // ---- header, advice --------------------------------------------------------------------
  function header() {
    const c = S.ctx || {};
    document.title = S.title + (c.hostname ? " · " + c.hostname : "") + " · live";
    const t = $("title");
    t.textContent = S.title + " ";
    t.appendChild(el("small", "", "live" + (c.hostname ? " · " + c.hostname : "")));
    const g = $("gpus");
    g.textContent = "";
    const gpus = c.gpus || [];
    const backend = c.backend || "";
    const parts = [];
    if (gpus.length) {
      for (const x of gpus) {
        const bits = [];
        if (x.mem_total_gb) {
          bits.push(x.mem_total_gb.toFixed(1) + " GB = " +
            (x.mem_total_gb * 1e9 / Math.pow(2, 30)).toFixed(1) + " GiB");
        }
        if (x.power_limit_w) bits.push(Math.round(x.power_limit_w) + " W limit");
        parts.push(["GPU " + x.index + ": ", x.name + (bits.length ? " (" + bits.join(", ") + ")"
          : "")]);
      }
    }
    parts.forEach(([a, b], k) => {
      if (k) g.appendChild(document.createTextNode(" · "));
      g.appendChild(el("b", "", a));
      g.appendChild(document.createTextNode(b));
    });
    if (backend) {
      g.appendChild(document.createTextNode((parts.length ? " · " : "") + "backend: " + backend
        + (c.interval ? ", sampled every " + c.interval + " s" : "")));
    }
    const banner = $("banner");
    if (backend === "simulated") {
      banner.textContent = "Simulated GPUs: these figures come from gpulens's GPU simulator "
        + "(a deterministic load wave), not from real hardware.";
      banner.hidden = false;
    } else if (backend === "none") {
      banner.textContent = "No GPU is monitored (no NVIDIA driver answered): host and "
        + "training figures only.";
      banner.hidden = false;
    } else {
      banner.hidden = true;
    }
  }
  function addEvents(evs) {
    for (const e of evs) S.events.push(e);
    if (S.events.length > 2000) S.events.splice(0, S.events.length - 2000);
    advice();
    schedule();
  }
  function advice() {
    const active = new Map();
    for (const e of S.events) {
      if (e.kind !== "alert") continue;
      if (e.state === "firing") active.set(e.name, e); else active.delete(e.name);
    }
    const box = $("active");
    box.textContent = "";
    if (!active.size) {
      box.appendChild(el("div", "none", S.events.length
        ? "Nothing is firing now (see the history below)."
        : "No advice so far: no rule has fired."));
    }
    for (const e of active.values()) {
      const a = el("div", "alert " + (e.severity || "warning"));
      a.dataset.rule = e.name;
      const what = el("div", "what", e.name.replace(/_/g, " ") + ": " + (e.message || "firing"));
      a.appendChild(what);
      if (e.advice) a.appendChild(el("div", "try", "Try: " + e.advice));
      a.appendChild(el("div", "when", "since step " + e.step + " (" + timeOfDay(e.time) + ")"));
      box.appendChild(a);
    }
    const list = $("events");
    list.textContent = "";
    const shown = S.events.slice(-300).reverse();
    for (const e of shown) {
      const li = el("li");
      const tagCls = "tag " + (e.state === "firing" ? "firing " + (e.severity || "") : e.state);
      li.appendChild(el("span", tagCls, e.kind === "alert" ? e.state : e.kind));
      li.appendChild(el("b", "", e.name));
      li.appendChild(document.createTextNode(" · step " + e.step + " · " + timeOfDay(e.time)
        + (e.message ? " — " + e.message : "")));
      if (e.advice && e.state !== "resolved") {
        li.appendChild(el("div", "adv", "Try: " + e.advice));
      }
      list.appendChild(li);
    }
    $("nevents").textContent = String(S.events.length);
    $("history").hidden = S.events.length === 0;
  }
  function status() {
    const st = $("status"), t = $("status-text");
    const n = S.rows.length, last = S.rows[n - 1];
    let text;
    if (S.ended) text = "the run ended; this page keeps what it received";
    else if (!S.live) text = S.run ? "reconnecting…" : "connecting…";
    else if (!n) text = "live · waiting for the first row";
    else {
      const ago = (Date.now() - S.lastRowAt) / 1000;
      const where = S.xmode === "elapsed" && X(last) !== null ? clock(X(last)) + " elapsed"
        : "step " + X(last);
      text = "live · " + n.toLocaleString("en-US") + " rows · " + where + " · " +
        (ago < 1.5 ? "just now" : fmt(ago) + " s ago");
    }
    t.textContent = text;
    st.className = S.ended ? "" : S.live ? "live" : "down";
  }

  // ---- ranges ----------------------------------------------------------------------------
  function ranges() {
    const bar = $("ranges");
    for (const [label, sec] of RANGES) {
      const b = el("button", sec === S.range ? "on" : "", label);
      b.dataset.range = String(sec);
      b.addEventListener("click", () => {
        S.range = sec;
        for (const x of bar.querySelectorAll("button")) x.className = x === b ? "on" : "";
        schedule();
      });
      bar.appendChild(b);
    }
    const xi = el("span");
    xi.id = "xinfo";
    bar.appendChild(xi);
  }

  // ---- the stream ------------------------------------------------------------------------
  function reset(h) {
    S.run = h.run;
    S.title = h.title || "gpulens";
    S.ctx = h.context || {};
    S.keys = [];
    S.col = new Map();
    S.rows = [];
    S.events = [];
    S.maxRows = h.history_rows || 8192;
    S.layoutIds = null;
    S.charts = new Map();
    header();
    addKeys(h.keys || []);
    advice();
    $("foot").textContent = "gpulens live dashboard · the page keeps up to " +
      S.maxRows.toLocaleString("en-US") + " rows (older ones thinned) · run " + h.run;
  }
  function connect() {
    const es = new EventSource("events");
    S.es = es;
    const on = (name, fn) => es.addEventListener(name, (ev) => {
      try { fn(JSON.parse(ev.data)); } catch (err) { report(err); }
    });
    on("hello", (h) => { S.live = true; reset(h); status(); });
    on("keys", addKeys);
    on("rows", addRows);
    on("events", addEvents);
    on("end", () => { S.ended = true; es.close(); status(); });
    es.onopen = () => { S.live = true; status(); };
    es.onerror = () => { S.live = false; status(); };
  }

  ranges();
  window.addEventListener("resize", schedule);
  setInterval(status, 1000);
  window.gpulens = {
    tickLabels: (lo, hi, n) => {
      const t = ticks(lo, hi, n), f = tickFormat(lo, hi, t.step);
      return t.values.map(f);
    },
    state: () => ({
      rows: S.rows.length, keys: S.keys.length, events: S.events.length, drawn: S.drawn,
      xmode: S.xmode, ended: S.ended, live: !!S.live, range: S.range, errors: S.errors.slice(),
      firstDataMs: S.firstDataMs,
      lastStep: S.rows.length ? S.rows[S.rows.length - 1][0] : null,
      charts: Object.fromEntries([...S.charts].map(([id, c]) => [id, {
        points: c.points, series: c.series.length, title: c.spec.title,
        section: c.spec.sec}])),
    }),
  };
  connect();
})();
