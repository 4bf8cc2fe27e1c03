// Small line plots drawn as inline SVG: no chart library. Each plot is an image with a text
// alternative (its last value and range), so a screen reader gets the number the line shows.

const NS = "http://www.w3.org/2000/svg";
const W = 240;
const H = 60;
const PAD = 4;

function svgEl(tag, attrs) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

// series: [{label, values: [number|null], cls}], times: [seconds], window: [t0, t1]
export function plot({ title, unit, series, times, window: [t0, t1], format }) {
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const max = Math.max(...all, 0) || 1;
  const x = (t) => PAD + ((t - t0) / Math.max(t1 - t0, 1)) * (W - 2 * PAD);
  const y = (v) => H - PAD - (v / max) * (H - 2 * PAD);
  const last = series.map((s) => {
    const v = [...s.values].reverse().find((u) => u !== null && u !== undefined);
    return `${s.label} ${v === undefined ? "none" : format(v)}`;
  });
  const described = `${title}: ${last.join(", ")}; highest ${format(max === 1 && !all.length ? 0 : max)}${unit}`;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": described, class: "plot" });
  svg.dataset.last = last.join(", "); // the figure's caption shows the latest values as text
  const t = svgEl("title", {});
  t.textContent = described;
  svg.append(t);
  svg.append(svgEl("line", { x1: PAD, x2: W - PAD, y1: H - PAD, y2: H - PAD, class: "axis" }));
  for (const s of series) {
    // A gap (a step with no requests) breaks the line instead of drawing a false zero.
    let run = [];
    const flush = () => {
      if (run.length === 1) svg.append(svgEl("circle", { cx: run[0][0], cy: run[0][1], r: 1.5, class: s.cls }));
      if (run.length > 1) svg.append(svgEl("polyline", { points: run.map((p) => p.join(",")).join(" "), class: s.cls }));
      run = [];
    };
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) flush();
      else run.push([x(times[i]).toFixed(1), y(v).toFixed(1)]);
    });
    flush();
  }
  return svg;
}
