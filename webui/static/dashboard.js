// Draws the Plotly figures the server renders into <script type="application/json" data-figures> elements:
// key -> figure, drawn into the element with id "chart-<key>". Re-run after every htmx swap (live updates).
(function () {
  "use strict";
  function draw() {
    if (!window.Plotly) return;
    document.querySelectorAll("script[data-figures]").forEach(function (el) {
      var figs = JSON.parse(el.textContent);
      Object.keys(figs).forEach(function (key) {
        var div = document.getElementById("chart-" + key);
        if (div) Plotly.react(div, figs[key].data, figs[key].layout, {responsive: true, displaylogo: false});
      });
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
})();
