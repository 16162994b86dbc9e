// gpulens live dashboard: numbers, axes and the chart class (loaded before page.js, which
// hands makeChart the page's state and helpers).
"use strict";
window.gpulensChart = (function () {
  // ---- numbers ---------------------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e8 ? 0 : 2) + "M";
    if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
    if (a >= 100) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    if (a === 0) return "0";
    if (a >= 0.01) return v.toFixed(3);
    return v.toExponential(2);
  }
  function niceStep(span, n) {
    const raw = span / Math.max(1, n);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= raw * (1 - 1e-9)) return m * p;
    return 10 * p;
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) return {values: [lo], step: 1};
    const step = niceStep(hi - lo, n), first = Math.ceil(lo / step - 1e-9), out = [];
    for (let k = first; (k * step) <= hi + step * 1e-9; k++) out.push(k === 0 ? 0 : k * step);
    return {values: out, step: step};
  }
  function decimals(x) {  // digits after the point that multiples of x need
    for (let d = 0; d < 10; d++) {
      const s = x * Math.pow(10, d);
      if (Math.abs(s - Math.round(s)) < 1e-6 * Math.max(1, s)) return d;
    }
    return 10;
  }
  // One format for every tick of an axis, so that the labels are distinct and alike.
  function tickFormat(lo, hi, step) {
    const mag = Math.max(Math.abs(lo), Math.abs(hi));
    if (mag >= 1e6) {
      const d = decimals(step / 1e6);
      return (v) => (v === 0 ? "0" : (v / 1e6).toFixed(d) + "M");
    }
    if (mag >= 1e4) {
      const d = decimals(step / 1e3);
      return (v) => (v === 0 ? "0" : (v / 1e3).toFixed(d) + "k");
    }
    if (step < 1e-3) {
      const e = Math.floor(Math.log10(step));
      const p = Math.floor(Math.log10(mag)) - e + decimals(step / Math.pow(10, e));
      return (v) => (v === 0 ? "0" : v.toExponential(Math.max(0, Math.min(12, p))));
    }
    const d = decimals(step);
    return (v) => v.toFixed(d);
  }
  function clock(sec) {
    const s = Math.max(0, Math.round(sec));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    const pad = (x) => String(x).padStart(2, "0");
    return h ? h + ":" + pad(m) + ":" + pad(r) : m + ":" + pad(r);
  }
  function timeOfDay(t) {
    return new Date(t * 1000).toLocaleTimeString("en-GB", {hour12: false});
  }

  // The chart reads the page's state (S) and helpers: page.js makes the class with them.
  function makeChart(page) {
    const {S, X, xRange, firstVisible, seriesOf, refsOf, el, COLORS} = page;

    // ---- a chart ---------------------------------------------------------------------------
    class Chart {
      constructor(spec) {
        this.spec = spec;
        this.box = el("div", "chart");
        this.box.dataset.chart = spec.id;
        const h = el("h3");
        this.h = h;
        this.nameEl = el("span", "", spec.title);
        h.appendChild(this.nameEl);
        if (spec.unit) h.appendChild(el("span", "unit", spec.unit));
        this.now = el("span", "now");
        h.appendChild(this.now);
        this.box.appendChild(h);
        this.legend = el("div", "legend");
        this.box.appendChild(this.legend);
        this.canvas = el("canvas");
        this.canvas.setAttribute("role", "img");
        this.canvas.setAttribute("aria-label", spec.title + (spec.unit ? " (" + spec.unit + ")"
          : "") + " over " + (S.xmode === "elapsed" ? "time" : "training steps"));
        this.box.appendChild(this.canvas);
        this.tip = el("div", "tip");
        this.tip.hidden = true;
        this.box.appendChild(this.tip);
        this.hover = null;
        this.points = 0;
        this.canvas.addEventListener("mousemove", (ev) => {
          const r = this.canvas.getBoundingClientRect();
          this.hover = ev.clientX - r.left;
          this.draw();
        });
        this.canvas.addEventListener("mouseleave", () => {
          this.hover = null;
          this.tip.hidden = true;
          this.draw();
        });
      }
      refresh() {
        this.series = seriesOf(this.spec);
        this.refs = refsOf(this.spec);
        this.legend.textContent = "";
        this.legendVals = [];
        if (this.series.length > 1 || this.spec.gpu) {
          for (const s of this.series) {
            const span = el("span");
            const sw = el("i");
            sw.style.background = s.color;
            span.appendChild(sw);
            span.appendChild(document.createTextNode(s.label + " "));
            const v = el("b", "", "–");
            span.appendChild(v);
            if (s.name) span.title = s.name;
            this.legend.appendChild(span);
            this.legendVals.push(v);
          }
        }
      }
      draw() {
        const cv = this.canvas, dpr = window.devicePixelRatio || 1;
        const W = cv.clientWidth, H = cv.clientHeight;
        if (!W || !H) return;
        if (cv.width !== Math.round(W * dpr) || cv.height !== Math.round(H * dpr)) {
          cv.width = Math.round(W * dpr);
          cv.height = Math.round(H * dpr);
        }
        const g = cv.getContext("2d");
        g.setTransform(dpr, 0, 0, dpr, 0, 0);
        g.clearRect(0, 0, W, H);
        const spec = this.spec, i0 = firstVisible(), rows = S.rows;
        const L = 50, R = 8, T = 6, B = 20, pw = W - L - R, ph = H - T - B;
        // every chart shares the x range of the rows in range: one step axis for the page
        let [xmin, xmax] = xRange(i0), ymin = Infinity, ymax = -Infinity, n = 0;
        for (const s of this.series) {
          for (let i = i0; i < rows.length; i++) {
            const v = rows[i][2 + s.col], x = X(rows[i]);
            if (v === null || v === undefined || x === null) continue;
            if (v < ymin) ymin = v;
            if (v > ymax) ymax = v;
            n++;
          }
        }
        // the newest value, also outside the range
        const latest = this.series.map((s) => {
          for (let i = rows.length - 1; i >= 0 && i >= rows.length - 50; i--) {
            const v = rows[i][2 + s.col];
            if (v !== null && v !== undefined) return v;
          }
          return null;
        });
        this.legendVals.forEach((b, k) => { b.textContent = fmt(latest[k]); });
        this.now.textContent = this.series.length === 1 && !spec.gpu ? fmt(latest[0]) : "";
        this.points = n;
        this.box.dataset.points = String(n);
        const refLines = [];
        if (n && this.refs.length) {
          for (const rf of this.refs) {
            for (let i = rows.length - 1; i >= i0; i--) {
              const v = rows[i][2 + rf.col];
              if (v !== null && v !== undefined) { refLines.push([rf.gpu, v]); break; }
            }
          }
        }
        if (n && spec.total) {
          for (const s of this.series) {
            const gi = (S.ctx.gpus || []).find((x) => x.index === s.gpu);
            if (gi && gi[spec.total]) refLines.push([s.gpu, gi[spec.total]]);
          }
        }
        for (const [, v] of refLines) if (v > ymax) ymax = v;
        g.font = "11px system-ui, sans-serif";
        g.textBaseline = "middle";
        if (!n) {
          g.fillStyle = "#99a";
          g.textAlign = "center";
          g.fillText("no data in this range", W / 2, H / 2);
          return;
        }
        if (spec.pct) { ymin = Math.min(0, ymin); ymax = Math.max(100, ymax); }
        else if (spec.zero) { ymin = Math.min(0, ymin); }
        if (ymax === ymin) { const d = Math.abs(ymax) * 0.1 || 1; ymin -= d; ymax += d; }
        else if (!spec.pct) {
          const pad = (ymax - ymin) * 0.06;
          ymax += pad;
          if (!(spec.zero && ymin === 0)) ymin -= pad;
        }
        if (xmax === xmin) { xmin -= 1; xmax += 1; }
        const px = (x) => L + (x - xmin) / (xmax - xmin) * pw;
        const py = (y) => T + (1 - (y - ymin) / (ymax - ymin)) * ph;
        // grid and labels
        const yt = ticks(ymin, ymax, Math.max(2, Math.floor(ph / 28)));
        const yf = tickFormat(ymin, ymax, yt.step);
        g.strokeStyle = "#eceef2";
        g.lineWidth = 1;
        g.fillStyle = "#667";
        g.textAlign = "right";
        for (const v of yt.values) {
          const y = Math.round(py(v)) + 0.5;
          g.beginPath(); g.moveTo(L, y); g.lineTo(W - R, y); g.stroke();
          g.fillText(yf(v), L - 5, y);
        }
        const nx = Math.max(3, Math.floor(pw / 45));
        let xt = S.xmode === "elapsed" ? timeTicks(xmin, xmax, nx) : ticks(xmin, xmax, nx);
        if (S.xmode !== "elapsed" && xt.step < 1) {  // steps are whole numbers
          const whole = [];
          for (let v = Math.ceil(xmin); v <= xmax; v++) whole.push(v);
          xt = {values: whole, step: 1};
        }
        const xf = S.xmode === "elapsed" ? (v) => (xt.step >= 1 ? clock(v) : v.toFixed(1) + " s")
          : tickFormat(xmin, xmax, xt.step);
        g.textAlign = "center";
        g.textBaseline = "top";
        for (const v of xt.values) {
          const x = Math.round(px(v)) + 0.5, label = xf(v);
          g.beginPath(); g.moveTo(x, T); g.lineTo(x, T + ph); g.stroke();
          const half = g.measureText(label).width / 2;  // kept inside the canvas
          g.fillText(label, Math.min(Math.max(x, L + half - 6), W - half - 1), T + ph + 4);
        }
        g.strokeStyle = "#c9ccd3";
        g.beginPath(); g.moveTo(L, T + ph + 0.5); g.lineTo(W - R, T + ph + 0.5); g.stroke();
        g.textAlign = "left";
        g.fillStyle = "#99a";
        g.fillText(S.xmode === "elapsed" ? "m:ss" : "step", 0, T + ph + 4);
        // alert markers
        g.fillStyle = "#d6452f";
        for (const e of S.events) {
          if (e.kind !== "alert" || e.state !== "firing") continue;
          const x = this.xOfStep(e.step, e.time);
          if (x === null || x < xmin || x > xmax) continue;
          const xp = px(x);
          g.beginPath(); g.moveTo(xp - 4, T); g.lineTo(xp + 4, T); g.lineTo(xp, T + 6);
          g.closePath(); g.fill();
        }
        // limits, dashed
        g.save();
        g.setLineDash([4, 3]);
        for (const [gpu, v] of refLines) {
          g.strokeStyle = COLORS[gpu % COLORS.length];
          g.globalAlpha = 0.5;
          const y = Math.round(py(v)) + 0.5;
          g.beginPath(); g.moveTo(L, y); g.lineTo(W - R, y); g.stroke();
        }
        g.restore();
        // series
        g.save();
        g.beginPath(); g.rect(L, T - 1, pw, ph + 2); g.clip();
        g.lineWidth = 1.5;
        g.lineJoin = "round";
        const count = rows.length - i0;
        for (const s of this.series) {
          g.strokeStyle = s.color;
          g.beginPath();
          if (count > pw * 2) {  // one min-max pair per pixel column
            let col = null, lo = 0, hi = 0, started = false;
            const flush = () => {
              if (col === null) return;
              if (!started) { g.moveTo(col, py(lo)); started = true; } else g.lineTo(col, py(lo));
              if (hi !== lo) g.lineTo(col, py(hi));
            };
            for (let i = i0; i < rows.length; i++) {
              const v = rows[i][2 + s.col], x = X(rows[i]);
              if (v === null || v === undefined || x === null) continue;
              const c = Math.round(px(x));
              if (c !== col) { flush(); col = c; lo = hi = v; }
              else { if (v < lo) lo = v; if (v > hi) hi = v; }
            }
            flush();
          } else {  // a line through the points; a point alone (gaps both sides) is a dot
            let run = 0, first = null;
            const alone = [];
            for (let i = i0; i <= rows.length; i++) {
              const r = rows[i], v = r ? r[2 + s.col] : null, x = r ? X(r) : null;
              if (v === null || v === undefined || x === null) {
                if (run === 1) alone.push(first);
                run = 0;
                continue;
              }
              if (run) g.lineTo(px(x), py(v));
              else { g.moveTo(px(x), py(v)); first = [px(x), py(v)]; }
              run++;
            }
            g.stroke();
            g.fillStyle = s.color;
            for (const [x, y] of alone) {
              g.beginPath(); g.arc(x, y, 2.5, 0, 2 * Math.PI); g.fill();
            }
            continue;
          }
          g.stroke();
        }
        g.restore();
        this.hoverAt(g, px, py, i0, L, W - R, T, ph);
      }
      xOfStep(step, time) {
        if (S.xmode !== "elapsed") return step;
        for (let i = S.rows.length - 1; i >= 0; i--) {
          if (S.rows[i][1] <= time + 1e-6) return X(S.rows[i]);
        }
        return null;
      }
      hoverAt(g, px, py, i0, left, right, T, ph) {
        if (this.hover === null || S.rows.length <= i0) { this.tip.hidden = true; return; }
        let best = -1, bd = Infinity;
        for (let i = i0; i < S.rows.length; i++) {
          const x = X(S.rows[i]);
          if (x === null) continue;
          const d = Math.abs(px(x) - this.hover);
          if (d < bd) { bd = d; best = i; }
        }
        if (best < 0 || this.hover < left || this.hover > right) {
          this.tip.hidden = true;
          return;
        }
        const r = S.rows[best], xp = Math.round(px(X(r))) + 0.5;
        g.strokeStyle = "rgba(0,0,0,.35)";
        g.beginPath(); g.moveTo(xp, T); g.lineTo(xp, T + ph); g.stroke();
        this.tip.textContent = "";
        const head = S.xmode === "elapsed" ? clock(X(r)) + " (step " + r[0] + ")"
          : "step " + X(r);
        this.tip.appendChild(el("div", "", head + " · " + timeOfDay(r[1])));
        for (const s of this.series) {
          const v = r[2 + s.col];
          const line = el("div");
          const sw = el("i");
          sw.style.background = s.color;
          line.appendChild(sw);
          line.appendChild(document.createTextNode(
            (this.series.length > 1 || this.spec.gpu ? s.label + ": " : "") + fmt(v) +
            (this.spec.unit ? " " + this.spec.unit : "")));
          this.tip.appendChild(line);
          if (v !== null && v !== undefined) {
            g.fillStyle = s.color;
            g.beginPath(); g.arc(xp, py(v), 3, 0, 2 * Math.PI); g.fill();
          }
        }
        this.tip.hidden = false;
        const bw = this.box.clientWidth, tw = this.tip.offsetWidth;
        let x = xp + 14;
        if (x + tw > bw - 4) x = Math.max(4, xp - tw - 10);
        this.tip.style.left = x + "px";
        this.tip.style.top = "44px";
      }
    }
    function timeTicks(lo, hi, n) {
      const span = hi - lo, raw = span / Math.max(1, n);
      const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
        21600, 43200, 86400];
      const step = steps.find((s) => s >= raw) || 86400 * Math.ceil(raw / 86400);
      const out = [];
      for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(v);
      return {values: out, step: step};
    }
    return Chart;
  }

  return {fmt, ticks, tickFormat, clock, timeOfDay, makeChart};
})();
