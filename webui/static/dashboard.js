// Draws the Plotly figures the server renders into <script type="application/json" data-figures> elements:
// key -> figure, drawn into the element with id "chart-<key>". Re-run after every htmx swap (live updates).
// Chart controls (webui/templates/_chart.html): the smoothing slider #smoothing (an EMA weight in [0, 1), the raw
// line kept faint behind the smoothed one) and a "log y" checkbox per chart ([data-log-y=<key>]); both are kept in
// localStorage, so a redraw, a reload and the next page keep them. Runs table: the column chooser's choice is kept in
// localStorage too and restored when /runs is opened without one.
(function () {
  "use strict";
  // Plotly's default colorway (D3 category10): a smoothed trace takes the colour its raw line would have had
  var COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  var store = {
    get: function (k) { try { return localStorage.getItem("asyncrl." + k); } catch (e) { return null; } },
    set: function (k, v) { try { localStorage.setItem("asyncrl." + k, v); } catch (e) { /* private mode */ } }
  };

  // Debiased exponential moving average, as TensorBoard's scalar smoothing (bias correction of Kingma & Ba 2015,
  // Adam, sec. 3): m = w*m + (1-w)*y over the finite points so far (n of them), smoothed = m / (1 - w^n).
  // A missing (null) value stays missing and does not move the average.
  function ema(ys, w) {
    var m = 0, n = 0;
    return ys.map(function (y) {
      if (y === null || y === undefined || !isFinite(y)) return null;
      m = w * m + (1 - w) * y;
      n += 1;
      return m / (1 - Math.pow(w, n));
    });
  }

  function smoothable(t) {
    return (t.type || "scatter") === "scatter" && t.meta !== "threshold" && (t.y || []).length > 1;
  }

  // The figure as drawn: with weight w > 0 each smoothable line becomes a faint raw line (meta "raw") and the
  // smoothed line (meta "smoothed") in the same colour and legend group; logY sets the y axis type.
  function shown(fig, w, logY) {
    var layout = Object.assign({}, fig.layout);
    layout.yaxis = Object.assign({}, layout.yaxis, {type: logY ? "log" : "linear"});
    if (!(w > 0)) return {data: fig.data, layout: layout};
    var data = [];
    fig.data.forEach(function (t, i) {
      var color = (t.line && t.line.color) || (t.marker && t.marker.color) || COLORS[i % COLORS.length];
      if (!smoothable(t)) {
        data.push(t.type === "bar" ? Object.assign({}, t, {marker: Object.assign({}, t.marker, {color: color})}) : t);
        return;
      }
      var group = t.legendgroup || "line-" + i;
      var line = Object.assign({}, t.line, {color: color});
      data.push(Object.assign({}, t, {meta: "raw", legendgroup: group, showlegend: false, opacity: 0.25,
                                      line: line, marker: Object.assign({}, t.marker, {color: color})}));
      data.push(Object.assign({}, t, {meta: "smoothed", legendgroup: group, mode: "lines", y: ema(t.y, w),
                                      line: line, name: t.name}));
    });
    return {data: data, layout: layout};
  }

  function weight() {
    var v = parseFloat(store.get("smoothing"));
    return isFinite(v) && v >= 0 && v < 1 ? v : 0;
  }

  function logY(key, fig) {
    var v = store.get("logy." + key);
    return v === null ? (fig.layout.yaxis || {}).type === "log" : v === "1";
  }

  function syncControls(figs) {
    var slider = document.getElementById("smoothing");
    if (slider) {
      slider.value = String(weight());
      var out = document.getElementById("smoothing-value");
      if (out) out.textContent = weight().toFixed(2);
    }
    document.querySelectorAll("input[data-log-y]").forEach(function (box) {
      var key = box.dataset.logY;
      if (figs[key]) box.checked = logY(key, figs[key]);
    });
  }

  function figures() {
    var all = {};
    document.querySelectorAll("script[data-figures]").forEach(function (el) {
      Object.assign(all, JSON.parse(el.textContent));
    });
    return all;
  }

  // Every htmx swap (status, events, logs... every few seconds each) calls draw(): a chart is drawn again only when
  // what it shows changed (its figure, the smoothing, its log axis: `drawnAs`, by element). Drawing every chart on
  // every swap kept a busy machine's browser drawing all the time, and the page stopped answering clicks.
  var drawnAs = new WeakMap();
  function draw() {
    var figs = figures();
    syncControls(figs);
    if (!window.Plotly) return;
    var w = weight();
    Object.keys(figs).forEach(function (key) {
      var div = document.getElementById("chart-" + key);
      if (!div) return;
      var log = logY(key, figs[key]);
      var drawn = JSON.stringify(figs[key]) + "|" + w + "|" + log;
      if (drawnAs.get(div) === drawn) return;
      var fig = shown(figs[key], w, log);
      Plotly.react(div, fig.data, fig.layout, {responsive: true, displaylogo: false});
      drawnAs.set(div, drawn);
    });
  }

  document.addEventListener("input", function (ev) {
    if (ev.target.id === "smoothing") { store.set("smoothing", ev.target.value); draw(); }
  });
  document.addEventListener("change", function (ev) {
    var t = ev.target;
    if (t.dataset && t.dataset.logY) { store.set("logy." + t.dataset.logY, t.checked ? "1" : "0"); draw(); }
  });

  // Runs table columns: the chooser form's choice is remembered; /runs without ?col= opens on the remembered one.
  function columns() {
    var form = document.getElementById("columns-form");
    if (!form) return;
    var params = new URLSearchParams(location.search);
    var saved = store.get("runs.columns");
    if (!params.has("col") && saved) {
      saved.split(",").forEach(function (c) { params.append("col", c); });
      location.replace(location.pathname + "?" + params.toString());
      return;
    }
    form.addEventListener("submit", function () {
      var cols = Array.prototype.map.call(form.querySelectorAll("[name=col]"), function (el) {
        return el.type === "checkbox" && !el.checked ? null : el.value;
      }).filter(function (c) { return c !== null; });
      store.set("runs.columns", cols.join(","));
    });
  }

  document.addEventListener("DOMContentLoaded", function () { columns(); draw(); });
  document.addEventListener("htmx:afterSettle", draw);
})();
