"""The UI's pages over HTTP: they render real data, escape everything agents and tasks wrote,
and carry a Content-Security-Policy."""

from __future__ import annotations

import pytest

from service.store import db
from tests.conftest import auth, client_for, make_settings
from tests.ui_data import XSS, hostile_run


@pytest.fixture
async def hostile(db_url):
    engine = db.make_async_engine(db_url)
    run_id, episodes = await hostile_run(engine)
    await engine.dispose()
    async with client_for(make_settings(db_url)) as client:
        client.headers.update(auth())  # the run is an oracle's: without the token its turns are redacted
        yield client, run_id, episodes


def assert_inert(html: str) -> None:
    assert "<script>window.__xss" not in html and "<img src=x" not in html and "<svg onload" not in html
    assert 'href="javascript:' not in html
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in html or "\\u003cscript" in html


async def test_every_page_escapes_untrusted_text_and_sends_a_csp(hostile):
    client, run_id, episodes = hostile
    suite = (await client.get("/api/v1/suites")).json()["items"][0]
    task = (await client.get(f"/api/v1/suites/{suite['id']}/tasks")).json()["items"][0]
    for path in ["/", f"/runs/{run_id}", f"/episodes/{episodes[0]}", f"/episodes/{episodes[1]}", "/suites",
                 f"/suites/{suite['id']}", f"/tasks/{task['id']}"]:
        response = await client.get(path)
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "object-src 'none'" in csp and "'unsafe-inline'" not in csp
        if path != "/suites":
            assert_inert(response.text)
    assert "content-security-policy" in (await client.get("/api/v1/health")).headers


async def test_episode_page_shows_the_turns_diff_and_report(hostile):
    client, run_id, episodes = hostile
    html = (await client.get(f"/episodes/{episodes[1]}")).text
    assert html.count('class="turn"') == 3 and 'id="turn-2"' in html
    assert 'class="d-add"' in html and 'class="d-del"' in html
    assert "FAIL_TO_PASS" in html and "resolution: <b>FULL</b>" in html
    assert f'href="/runs/{run_id}"' in html and 'id="prev-episode"' in html and 'id="next-episode"' in html


async def test_turns_page_by_page(hostile):
    client, _, episodes = hostile
    page = (await client.get(f"/api/v1/episodes/{episodes[0]}", params={"turns_offset": 1, "turns_limit": 1})).json()
    assert [t["idx"] for t in page["turns"]] == [1]
    assert page["turns"][0]["text"].endswith(XSS)  # the API returns the text as it is; pages escape it


async def test_missing_things_are_404(hostile):
    client, _, _ = hostile
    import uuid

    for path in (f"/runs/{uuid.uuid4()}", f"/episodes/{uuid.uuid4()}", f"/suites/{uuid.uuid4()}", f"/tasks/{uuid.uuid4()}"):
        assert (await client.get(path)).status_code == 404


async def test_the_runs_list_reports_what_each_run_reports(hostile, db_url):
    client, run_id, _ = hostile
    engine = db.make_async_engine(db_url)
    second, _ = await hostile_run(engine)
    await engine.dispose()
    listed = {r["id"]: r for r in (await client.get("/api/v1/runs")).json()["items"]}
    assert set(listed) == {str(run_id), str(second)}
    for rid in listed:
        assert listed[rid] == (await client.get(f"/api/v1/runs/{rid}")).json()


async def test_tokens_and_staleness(hostile, db_url):
    import sqlalchemy as sa

    from service.store.tables import Group

    client, run_id, episodes = hostile
    missing = await client.get(f"/api/v1/episodes/{episodes[0]}/tokens", params={"turn": 0})
    assert missing.status_code == 409 and "/nonexistent" in missing.json()["detail"]  # names the tokenizer folder
    assert (await client.get(f"/api/v1/episodes/{episodes[0]}/tokens", params={"turn": 99})).status_code == 404
    engine = db.make_async_engine(db_url)
    async with engine.begin() as conn:
        await conn.execute(sa.update(Group).where(Group.run_id == run_id)
                           .values(status="consumed", trainer_step=3, min_policy_version=0))
    await engine.dispose()
    html = (await client.get(f"/runs/{run_id}")).text
    assert 'id="chart-staleness"' in html and "&#34;staleness&#34;: [2, 2]" in html
