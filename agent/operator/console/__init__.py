"""The operator's web console (`edge-agent fleet console`, docs/ROLLOUTS.md "The console"): a
read-only web page of the fleet served by the operator's own process: inventory by group,
profile and version, rollouts with their waves and gate figures drawn as charts, and each
device's health since the console started. Starlette and uvicorn serve it, jinja2 writes the
pages and plotly.js (from the `plotly` package, the `console` extra) draws the charts; nothing
is fetched from the network at run time.
"""
