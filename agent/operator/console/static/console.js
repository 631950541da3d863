// Draws every chart of the page with plotly.js: each <div class="chart" data-figure="ID"> takes
// its figure ({data, layout}) from the JSON in <script type="application/json" id="ID">.
(function () {
  "use strict";
  function draw() {
    var charts = document.querySelectorAll("div.chart[data-figure]");
    for (var i = 0; i < charts.length; i++) {
      var el = charts[i];
      var source = document.getElementById(el.getAttribute("data-figure"));
      if (!source) { continue; }
      var figure = JSON.parse(source.textContent);
      Plotly.newPlot(el, figure.data, figure.layout, {displaylogo: false, responsive: true})
        .then(function (gd) { gd.setAttribute("data-drawn", "yes"); });
    }
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
