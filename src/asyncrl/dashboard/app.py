"""`asyncrl dashboard`: a local web page over run folders: live charts, configs, logs, and a rollout viewer.

The server only reads files (asyncrl/dashboard/runs.py) and answers JSON; the page (static/) draws the
charts with uPlot, vendored from npm into static/vendor/, so nothing is fetched from outside the machine.
It binds to loopback by default: the page shows configs and logs, which may hold paths and hostnames.
"""

from __future__ import annotations

import socket
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from asyncrl.dashboard import runs as run_files
from asyncrl.dashboard.panels import PANELS, chart_of, unit_of
from asyncrl.errors import AsyncRLError
from asyncrl.metric_names import describe

STATIC = Path(str(resources.files("asyncrl.dashboard") / "static"))


def create_app(paths: list[Path]) -> FastAPI:
    app = FastAPI(title="asyncrl dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    sample_indexes: dict[Path, run_files.SampleIndex] = {}

    def run_path(run: str) -> Path:
        found = run_files.find_runs(paths).get(run)
        if found is None:
            raise HTTPException(404, f"no run named '{run}'")
        return found

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/runs")
    def list_runs() -> list[dict]:
        return [{"name": name, "path": str(path)} for name, path in run_files.find_runs(paths).items()]

    @app.get("/api/panels")
    def panels() -> list[str]:
        return [panel.title for panel in PANELS]

    @app.get("/api/runs/{run:path}/metrics")
    def metrics(run: str, offset: int = 0) -> dict:
        chunk = run_files.read_lines(run_path(run) / "metrics.jsonl", offset)
        names = {k for record in chunk.records for k in record if k not in ("step", "source", "time")}
        charts = {}
        for name in names:
            title = chart_of(name)
            if title is not None:
                metric = describe(name)
                charts[name] = {"chart": title, "unit": unit_of(name), "meaning": metric.meaning if metric else ""}
        return {"records": chunk.records, "offset": chunk.offset, "reset": chunk.reset, "charts": charts}

    @app.get("/api/runs/{run:path}/configs")
    def configs(run: str) -> dict[str, str]:
        return run_files.configs(run_path(run))

    @app.get("/api/runs/{run:path}/logs")
    def logs(run: str, name: str | None = None, lines: int = 200) -> dict:
        path = run_path(run)
        if name is None:
            return {"logs": run_files.log_files(path)}
        try:
            return {"name": name, "text": run_files.log_tail(path, name, lines)}
        except KeyError:
            raise HTTPException(404, f"no log '{name}' in {path / 'logs'}") from None

    @app.get("/api/runs/{run:path}/samples")
    def samples(run: str, step: int | None = None) -> dict:
        path = run_path(run) / "samples.jsonl"
        index = sample_indexes.setdefault(path, run_files.SampleIndex(path))
        steps = index.steps()
        if step is None:
            step = steps[-1] if steps else 0
        return {"steps": steps, "step": step, "records": index.records(step) if step in steps else []}

    @app.middleware("http")
    async def revalidate(request, call_next):
        # A browser may otherwise keep an older asyncrl's page and scripts from its cache.
        response = await call_next(request)
        response.headers["Cache-Control"] = "no-cache"
        return response

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise AsyncRLError(f"port {port} on {host} is in use (pass --port with another one, or 0)") from None


def serve(paths: list[Path], host: str, port: int) -> int:
    import uvicorn

    run_files.check_paths(paths)
    check_port_free(host, port)
    config = uvicorn.Config(create_app(paths), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    found = run_files.find_runs(paths)
    print(f"asyncrl dashboard: {len(found)} run(s) from {', '.join(map(str, paths))}", flush=True)

    # The port is known only once uvicorn has bound it (port 0 picks a free one).
    original_startup = server.startup

    async def startup(sockets=None):
        await original_startup(sockets)
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        print(f"asyncrl dashboard: open http://{host}:{bound}/", flush=True)

    server.startup = startup
    server.run()
    return 0
