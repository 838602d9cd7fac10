"""The page's two static files, kept as text in this module so that any install of the package (the
image's plain ``pip install``, no package data) carries them.

ui.js refreshes a job's page from /api/jobs/<id> without a reload. It writes data only through
``textContent``, a <progress>'s ``value``, ``hidden`` and SVG attributes made with createElementNS:
never ``innerHTML``, so a field holding markup cannot become an element. It uses no library.
"""

from __future__ import annotations

UI_JS = r"""'use strict';
(function () {
  var body = document.body;
  var jobId = body.getAttribute('data-job-id');
  if (!jobId) { return; }
  var pollMs = parseInt(body.getAttribute('data-poll-ms'), 10) || 3000;
  var SVG = 'http://www.w3.org/2000/svg';

  function at(data, path) {
    return path.split('.').reduce(function (v, k) { return v == null ? v : v[k]; }, data);
  }

  function chart(c, w, h) {
    var figure = document.createElement('figure');
    figure.className = 'chart';
    figure.setAttribute('data-points', String(c.count));
    var caption = document.createElement('figcaption');
    caption.textContent = c.stage + ' \u00b7 ' + c.metric;
    var svg = document.createElementNS(SVG, 'svg');
    svg.setAttribute('viewBox', '0 0 ' + w + ' ' + h);
    svg.setAttribute('width', String(w));
    svg.setAttribute('height', String(h));
    svg.setAttribute('role', 'img');
    svg.setAttribute('aria-label', caption.textContent);
    var frame = document.createElementNS(SVG, 'rect');
    frame.setAttribute('class', 'frame');
    frame.setAttribute('x', '0'); frame.setAttribute('y', '0');
    frame.setAttribute('width', String(w)); frame.setAttribute('height', String(h));
    var line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('class', 'curve');
    line.setAttribute('points', c.points);
    svg.appendChild(frame); svg.appendChild(line);
    var note = document.createElement('p');
    note.className = 'muted';
    note.textContent = c.steps + ' \u00b7 min ' + c.min + ' \u00b7 max ' + c.max + ' \u00b7 latest ' + c.last;
    figure.appendChild(caption); figure.appendChild(svg); figure.appendChild(note);
    return figure;
  }

  function drawCharts(charts) {
    var box = document.querySelector('[data-charts]');
    if (!box || !charts || !charts.length) { return; }
    var old = box.querySelector('svg');
    var w = old ? old.getAttribute('width') : '480', h = old ? old.getAttribute('height') : '160';
    var figures = charts.map(function (c) { return chart(c, w, h); });
    box.replaceChildren.apply(box, figures);
  }

  function apply(data) {
    document.querySelectorAll('[data-field]').forEach(function (el) {
      var v = at(data, el.getAttribute('data-field'));
      el.textContent = v == null ? '' : String(v);
    });
    document.querySelectorAll('progress[data-value]').forEach(function (el) {
      var v = at(data, el.getAttribute('data-value'));
      if (typeof v === 'number') { el.value = v; } else { el.removeAttribute('value'); }
    });
    document.querySelectorAll('[data-show]').forEach(function (el) {
      el.hidden = at(data, el.getAttribute('data-show')) == null;
    });
    drawCharts(data.charts);
  }

  function poll() {
    fetch('/api/jobs/' + encodeURIComponent(jobId), {cache: 'no-store', credentials: 'same-origin'})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (data) { apply(data); }
        if (!data || !data.final) { setTimeout(poll, pollMs); } else { stopped(' (reload for its final results)'); }
      })
      .catch(function () { setTimeout(poll, pollMs); });
  }

  function stopped(more) {
    var live = document.querySelector('[data-live]');
    if (live) { live.textContent = 'the job has ended: no more updates' + (more || ''); }
  }

  if (body.getAttribute('data-final') === '1') { stopped(); } else { setTimeout(poll, pollMs); }
})();
"""

UI_CSS = """
:root { color-scheme: light dark; --line: #2a6fdb; --muted: #777; --bad: #b3261e; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; }
header { display: flex; gap: 1.5em; align-items: baseline; padding: .6em 1.2em; border-bottom: 1px solid #8884; }
nav a { margin-right: 1em; }
nav a[aria-current] { font-weight: bold; text-decoration: none; }
main { padding: .5em 1.2em 3em; max-width: 1200px; }
h1 .ident { font-family: ui-monospace, monospace; font-size: .8em; overflow-wrap: anywhere; }
/* Any value may be long (another writer's record): it wraps anywhere instead of widening the page. */
td, dd, figcaption, p, h1, pre, .wrap { overflow-wrap: anywhere; word-break: break-word; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; }
th, td { text-align: left; padding: .25em .5em; border-bottom: 1px solid #8883; vertical-align: top; }
dl { display: grid; grid-template-columns: 11em minmax(0, 1fr); gap: .2em 1em; }
dt { color: var(--muted); }
dd { margin: 0; min-width: 0; }
pre { white-space: pre-wrap; max-height: 30em; overflow: auto; background: #8881; padding: .5em; }
pre:empty { display: none; }
progress { width: 16em; vertical-align: middle; }
progress:not([value]) { visibility: hidden; }  /* no percent known: no bar, rather than a busy one */
table.jobs th:nth-child(1) { width: 26%; }
table.jobs th:nth-child(5) { width: 34%; }
table.files th:first-child { width: 12em; }
.muted { color: var(--muted); }
.problem, .stale { color: var(--bad); }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { margin: 0; max-width: 100%; }
.chart svg { max-width: 100%; height: auto; }
.chart .frame { fill: none; stroke: #8886; }
.chart .curve { fill: none; stroke: var(--line); stroke-width: 1.5; }
.filters { display: flex; flex-wrap: wrap; gap: 1em; align-items: end; margin-bottom: 1em; }
"""
