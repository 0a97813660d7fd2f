"""The UI in headless Chromium (Debian's, driven by Playwright) against a running service with
real runs: an oracle run and a tiny-model run on vLLM executed by the embedded worker, a run
whose progress arrives live, and hostile data. Screenshots go to var/screenshots/."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from service.store import db
from service.fleet.tiny_model import init_tiny
from tests.conftest import TOKEN, auth, make_settings, missing_service
from tests.sandbox_fixtures import require_bwrap
from tests.servers import ThreadServer
from tests.test_rollout_e2e import SUITE
from tests.ui_data import hostile_run

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SHOTS = Path(__file__).resolve().parent.parent / "var" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def wait_run(client: httpx.Client, run_id: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = client.get(f"/api/v1/runs/{run_id}").json()
        if state["status"] not in ("pending", "running", "cancelling"):
            return state
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} not done: {state}")


@pytest.fixture(scope="module")
def service(tmp_path_factory, vllm_fleet):
    require_bwrap()
    if not Path(CHROMIUM).exists():
        missing_service("Debian's chromium (apt-get install chromium)")
    tmp = tmp_path_factory.mktemp("ui")
    url = f"sqlite:///{tmp / 'swerve.db'}"
    db.upgrade(url)
    settings = make_settings(url, broker_url="memory://", embedded_worker=True, data_dir=tmp)
    from service.app import create_app

    # written before the service starts, and held (ui_data.hold): its scanner adopts active runs
    # nobody owns, and its worker would run the episodes these write turn by turn
    hostile_id, hostile_episodes = asyncio.run(_hostile(db.make_async_engine(url)))
    _, long_episodes = asyncio.run(_hostile(db.make_async_engine(url), n_turns=55))  # more than a page
    training, training_group, _ = asyncio.run(_training(db.make_async_engine(url)))

    with ThreadServer(create_app(settings)) as server:
        with httpx.Client(base_url=server.url, headers=auth(), timeout=60) as client:
            body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
            suite = client.post("/api/v1/suites", params={"name": "example"}, content=body,
                                headers={"Content-Type": "application/x-ndjson"}).json()
            tokenizer = init_tiny(tmp / "tiny")
            oracle = client.post("/api/v1/runs", json={"suite_id": suite["id"], "name": "oracle", "samples_per_task": 2,
                                                       "sampler": {"type": "oracle", "tokenizer": str(tokenizer)}}).json()
            model = client.post("/api/v1/runs", json={
                "suite_id": suite["id"], "name": "tiny model", "samples_per_task": 2,
                "sampler": {"type": "vllm", "endpoints": [vllm_fleet.url("dense-a")], "model": "tiny",
                           "tokenizer": str(vllm_fleet.models["dense"])},
                "agent": {"max_turns": 3, "sampling": {"max_tokens": 32}}}).json()
            assert wait_run(client, oracle["id"])["status"] == "finished"
            assert wait_run(client, model["id"])["status"] == "finished"
            yield {"url": server.url, "client": client, "oracle": oracle["id"], "model": model["id"],
                   "long_hostile": str(long_episodes[0]),
                   "hostile": str(hostile_id), "hostile_episodes": [str(e) for e in hostile_episodes],
                   "suite": suite["id"], "tokenizer": tokenizer, "training": str(training),
                   "training_group": str(training_group)}


async def _training(engine):
    from tests.test_ui_training import build_training

    try:
        return await build_training(engine)
    finally:
        await engine.dispose()


async def _hostile(engine, n_turns: int = 3):
    try:
        return await hostile_run(engine, n_turns=n_turns)
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()


class Page:
    """A page that records console errors and uncaught exceptions; with `token`, it first gives
    the API token to the header's form, so answers (oracle turns, test logs) are shown."""

    def __init__(self, browser, base: str, token: str | None = TOKEN):
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.base, self.errors = base, []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))
        if token is not None:
            self.show_answers("/", token)

    def show_answers(self, path: str, token: str):
        page = self.open(path)
        page.fill("#answers-token", token)
        page.click("#show-answers")
        page.wait_for_selector("#hide-answers")
        page.wait_for_selector("body[data-ready=yes]")
        return page

    def open(self, path: str):
        self.page.goto(self.base + path)
        self.page.wait_for_selector("body[data-ready=yes]")
        return self.page

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_a_training_run_draws_its_steps_evaluations_and_groups(service, browser):
    p = Page(browser, service["url"])
    page = p.open(f"/runs/{service['training']}")
    for chart in ("chart-train-reward", "chart-train-policy", "chart-train-groups", "chart-train-time"):
        # Chart.js sized and drew the canvas (a chart that failed leaves it 0 x 0 or throws)
        assert page.evaluate(f"document.getElementById('{chart}').width") > 0, chart
        assert page.evaluate(f"!!window.Chart.getChart(document.getElementById('{chart}'))"), chart
    assert page.locator("#evals tbody tr").count() == 1 and "0.500 [" in page.locator("#evals").inner_text()
    assert page.locator("#difficulty td.rate").count() >= 1
    shaded = page.evaluate("getComputedStyle(document.querySelector('#difficulty td.rate[data-rate=\"0.5\"]'))"
                           ".backgroundColor")
    assert shaded.startswith("rgba(21, 128, 61"), shaded
    p.shot("run-training")
    page = p.open(f"/groups/{service['training_group']}")
    assert page.locator(".sample").count() == 2 and page.evaluate("window.__xss") is None
    p.shot("group")
    assert p.errors == []


def test_pages_load_with_real_runs_and_no_console_errors(service, browser):
    p = Page(browser, service["url"])
    page = p.open("/")
    assert page.locator("tr[data-run]").count() >= 3
    p.shot("runs")
    for name in ("oracle", "model"):
        page = p.open(f"/runs/{service[name]}")
        assert page.locator("#tasks tbody tr").count() == 2 and page.locator("#episodes tbody tr").count() == 4
        assert page.locator("canvas#chart-reward-time").count() == 1
        p.shot(f"run-{name}")
    oracle_episodes = service["client"].get(f"/api/v1/runs/{service['oracle']}/episodes").json()["items"]
    page = p.open(f"/episodes/{oracle_episodes[0]['id']}")
    assert page.locator(".turn").count() == oracle_episodes[0]["n_turns"] == 3
    assert "str_replace_editor" in page.locator("#turn-0 pre.tool-call").inner_text()
    assert page.locator("pre.diff .d-add").count() > 0 and "FULL" in page.locator("text=resolution").inner_text()
    p.shot("episode-oracle")
    model_episodes = service["client"].get(f"/api/v1/runs/{service['model']}/episodes").json()["items"]
    page = p.open(f"/episodes/{model_episodes[0]['id']}")
    assert page.locator(".turn").count() == model_episodes[0]["n_turns"]
    p.shot("episode-model")
    page = p.open("/suites")
    page.click(f"a[href='/suites/{service['suite']}']")
    page.wait_for_selector("#tasks")
    page.locator("#tasks a").first.click()
    page.wait_for_selector("pre.statement")
    p.shot("task")
    assert p.errors == []


def test_nothing_an_agent_or_task_wrote_runs(service, browser):
    p = Page(browser, service["url"])
    for path in ["/", f"/runs/{service['hostile']}", *[f"/episodes/{e}" for e in service["hostile_episodes"]]]:
        page = p.open(path)
        assert page.evaluate("window.__xss") is None, path
    page = p.open(f"/episodes/{service['hostile_episodes'][0]}")
    assert "<script>window.__xss = 1</script>" in page.locator("#turn-0 pre.assistant").inner_text()
    assert page.locator("#evil").count() == 0 and page.locator("img[src=x]").count() == 0
    task = service["client"].get(f"/api/v1/suites").json()["items"]
    hostile_suite = next(s for s in task if s["name"].startswith("hostile"))
    tasks = service["client"].get(f"/api/v1/suites/{hostile_suite['id']}/tasks").json()["items"]
    page = p.open(f"/tasks/{tasks[0]['id']}")
    assert "javascript:window.__xss = 3" in page.locator("pre.statement").inner_text()
    assert page.evaluate("window.__xss") is None
    p.shot("hostile-task")
    assert p.errors == []


def test_keyboard_moves_between_turns_and_episodes(service, browser):
    p = Page(browser, service["url"])
    first, second = service["hostile_episodes"][:2]
    page = p.open(f"/episodes/{first}")
    page.keyboard.press("j")
    assert page.evaluate("location.hash") == "#turn-0"
    page.keyboard.press("j")
    page.keyboard.press("j")
    assert page.evaluate("location.hash") == "#turn-2"
    page.keyboard.press("k")
    assert page.evaluate("location.hash") == "#turn-1"
    assert page.locator("#turn-1.current").count() == 1
    page = p.open(f"/episodes/{first}#turn-2")  # deep link to a turn
    assert page.locator("#turn-2.current").count() == 1
    page.keyboard.press("n")
    page.wait_for_url(f"**/episodes/{second}")
    page.wait_for_selector("body[data-ready=yes]")
    page.keyboard.press("p")
    page.wait_for_url(f"**/episodes/{first}")
    assert p.errors == []


def test_progress_arrives_live(service, browser):
    client = service["client"]
    calls = [{"name": "bash", "arguments": {"command": "sleep 1.5"}}] * 3
    run = client.post("/api/v1/runs", json={"suite_id": service["suite"], "name": "live", "samples_per_task": 1,
                                            "sampler": {"type": "replay", "tokenizer": str(service["tokenizer"]),
                                                       "calls": calls}}).json()
    p = Page(browser, service["url"])
    page = p.open("/")
    row = page.locator(f"tr[data-run='{run['id']}']")
    assert row.get_attribute("data-active") == "yes"
    # the CSP forbids string evaluation (wait_for_function): poll the DOM from here
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and row.locator("[data-field=status]").inner_text() != "finished":
        time.sleep(0.25)
    assert row.locator("[data-field=status]").inner_text() == "finished"
    assert int(row.get_attribute("data-updates") or 0) >= 2  # several progress events reached the page
    assert row.locator("[data-field=done]").inner_text() == "2"
    p.shot("runs-live")
    assert p.errors == []


def test_sampled_tokens_are_shaded_by_logprob(service, browser):
    client = service["client"]
    episode = client.get(f"/api/v1/runs/{service['model']}/episodes").json()["items"][0]
    detail = client.get(f"/api/v1/episodes/{episode['id']}", params={"arrays": "json"}).json()
    p = Page(browser, service["url"])
    page = p.open(f"/episodes/{episode['id']}")
    page.check("#shade")
    page.wait_for_selector("#turn-0 pre.shaded")
    spans = page.locator("#turn-0 pre.shaded .tok")
    ids = detail["turns"][0]["output_ids"]
    assert spans.count() == len(ids)
    # every sampled token can be seen, the ones that decode to no text alone by their id (the
    # random model samples ids past the tokenizer's vocabulary)
    texts = spans.all_text_contents()
    assert all(texts), [(i, t) for i, t in zip(ids, texts) if not t]
    served = client.get(f"/api/v1/episodes/{episode['id']}/tokens", params={"turn": 0}).json()["tokens"]
    assert [t["id"] for t in served] == ids
    blank = page.locator("#turn-0 pre.shaded .tok.blank").all_text_contents()
    assert blank == [f"\u27e8{t['id']}\u27e9" for t in served if t["text"] == ""]
    assert page.locator("#turn-0 pre.assistant:not(.shaded)").is_hidden()
    p.shot("episode-shaded")
    page.uncheck("#shade")
    assert page.locator("#turn-0 pre.shaded").is_hidden()
    assert p.errors == []


def test_answers_are_redacted_without_the_token(service, browser):
    episode = service["long_hostile"]  # of an oracle run
    p = Page(browser, service["url"], token=None)
    page = p.open(f"/episodes/{episode}")
    assert page.locator(".turn .redacted").count() == 50 and page.locator("#shade").count() == 0
    assert page.locator(".turn pre.assistant").count() == 0 and "redacted: needs the API token" in page.locator("#turn-0").inner_text()
    page.keyboard.press("End")  # the rest arrive from the API as the reader nears the end, redacted the same way
    page.wait_for_selector("#turn-54 .redacted")
    p.shot("episode-redacted")
    page = p.show_answers(f"/episodes/{episode}", TOKEN)
    assert page.url.endswith(f"/episodes/{episode}") and page.locator(".turn .redacted").count() == 0
    assert "<script>window.__xss = 1</script>" in page.locator("#turn-0 pre.assistant").inner_text()
    page.click("#hide-answers")
    page.wait_for_selector("#show-answers")
    assert page.locator(".turn .redacted").count() == 50
    assert p.errors == []


def test_the_api_docs_render_from_packaged_assets_under_the_csp(service, browser):
    p = Page(browser, service["url"], token=None)
    requests = []
    p.page.on("request", lambda r: requests.append(r.url))
    p.page.goto(service["url"] + "/docs")
    p.page.wait_for_selector(".opblock")
    assert p.page.locator(".opblock").count() >= 20 and "swerve" in p.page.locator(".info .title").inner_text()
    assert "content-security-policy" in httpx.get(service["url"] + "/docs").headers
    assert all(u.startswith(service["url"]) or u.startswith("data:") for u in requests), requests  # no CDN
    p.shot("api-docs")
    assert p.errors == []  # a CSP violation is a console error


def test_more_turns_arrive_once_however_they_are_asked_for(service, browser):
    """The button's click and the observer seeing it ask at the same moment: one fetch, no
    turn twice."""
    p = Page(browser, service["url"])
    page = p.open(f"/episodes/{service['long_hostile']}")
    assert page.locator(".turn").count() == 50
    # in one task: the button comes into view (the observer will fire) and is clicked
    page.evaluate("(() => { const b = document.getElementById('more-turns'); b.scrollIntoView(); b.click(); })()")
    page.wait_for_selector("#turn-54")
    page.wait_for_timeout(500)  # let any second fetch land
    idx = page.evaluate("Array.from(document.querySelectorAll('.turn')).map((t) => t.dataset.idx)")
    assert idx == [str(i) for i in range(55)], idx
    assert p.errors == []


def test_shading_is_tried_again_when_the_tokenizer_is_not_ready(service, browser):
    """A 409 (the tokenizer still loading after a restart) is tried again, and the turn is
    shaded once the server answers."""
    client = service["client"]
    episode = client.get(f"/api/v1/runs/{service['model']}/episodes").json()["items"][0]
    p = Page(browser, service["url"])
    refused = []

    def first_two_refused(route):
        if len(refused) < 2:
            refused.append(route.request.url)
            route.fulfill(status=409, content_type="application/json", body='{"detail": "tokenizer loading"}')
        else:
            route.continue_()

    p.page.route("**/tokens?turn=0", first_two_refused)
    page = p.open(f"/episodes/{episode['id']}")
    page.check("#shade")
    page.wait_for_selector("#turn-0 pre.shaded", timeout=15_000)
    assert len(refused) == 2 and page.locator("#turn-0").get_attribute("data-shaded") == "yes"
    assert [e for e in p.errors if "409" not in e] == []  # the browser logs the refused fetches themselves
