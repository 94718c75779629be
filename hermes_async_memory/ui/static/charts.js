// The inspector's charts: each <figure data-chart data-series="a,b"> on the page becomes a
// uPlot chart of those columns of series.json (the pipeline's last hour), refreshed every
// 10 s. No data goes into the page as script: it is fetched from this origin.
(function () {
  "use strict";
  var COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700"];
  var REFRESH_MS = 10000;
  var charts = [];

  function columns(data, names) {
    var cols = [data.t || []];
    names.forEach(function (n) { cols.push(data[n] || []); });
    return cols;
  }

  function build(fig, data) {
    var names = fig.dataset.series.split(",");
    var opts = {
      title: fig.dataset.title,
      width: 420,
      height: 180,
      series: [{}].concat(names.map(function (n, i) {
        return { label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false };
      })),
      // The last hour, whatever the samples span: a chart's left edge is an hour ago.
      scales: { x: { time: true, range: function () {
        var now = Date.now() / 1000;
        return [now - 3600, now];
      } } },
      axes: [{}, { size: 56 }],
    };
    var chart = new uPlot(opts, columns(data, names), fig);
    fig.setAttribute("data-drawn", String((data.t || []).length));
    charts.push({ fig: fig, chart: chart, names: names });
  }

  function load() {
    var src = document.querySelector(".charts").dataset.src;
    return fetch(src, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); });
  }

  function refresh() {
    load().then(function (data) {
      charts.forEach(function (c) {
        c.chart.setData(columns(data, c.names));
        c.fig.setAttribute("data-drawn", String((data.t || []).length));
      });
    }).catch(function () { /* the next round tries again */ });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var figs = document.querySelectorAll("figure[data-chart]");
    if (!figs.length || typeof uPlot === "undefined") { return; }
    load().then(function (data) {
      figs.forEach(function (fig) { build(fig, data); });
      setInterval(refresh, REFRESH_MS);
    }).catch(function (e) {
      figs.forEach(function (fig) { fig.textContent = "charts unavailable: " + e; });
    });
  });
})();
