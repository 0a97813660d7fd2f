// swerve UI: live updates from the events stream, charts, lazy turns, keyboard navigation.
// Untrusted text (anything an agent or a task wrote) is only ever set with textContent.
"use strict";

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  return typeof value === "number" && digits !== undefined ? value.toFixed(digits) : String(value);
}

function statusText(episodes) {
  return Object.keys(episodes).sort().map((k) => `${k} ${episodes[k]}`).join(", ");
}

function setField(root, name, text) {
  root.querySelectorAll(`[data-field="${name}"]`).forEach((el) => { el.textContent = text; });
}

// Subscribe a container (a runs-table row, the run page's cards) to its run's progress.
function live(root) {
  const run = root.dataset.run;
  if (!run || root.dataset.active !== "yes" || !window.EventSource) return;
  const source = new EventSource(`/api/v1/events?run=${encodeURIComponent(run)}`);
  source.addEventListener("progress", (event) => {
    const p = JSON.parse(event.data);
    const total = Object.values(p.episodes).reduce((a, b) => a + b, 0);
    const done = p.final;
    setField(root, "status", p.status);
    setField(root, "episodes", statusText(p.episodes));
    setField(root, "reward_mean", fmt(p.reward_mean, 3));
    setField(root, "pass_at_1", fmt(p.pass_at_1, 3));
    setField(root, "pass_at_k", fmt(p.pass_at_k, 3));
    setField(root, "tokens", (p.tokens || 0).toLocaleString("en"));
    setField(root, "episodes_per_s", fmt(p.episodes_per_s, 2));
    setField(root, "guarded", String(p.guarded ?? 0));
    setField(root, "done", String(done));
    setField(root, "total", String(total));
    root.querySelectorAll('progress[data-field="progress"]').forEach((bar) => { bar.max = total || 1; bar.value = done; });
    const badge = document.getElementById("run-status");
    if (badge) { badge.textContent = p.status; badge.className = `badge ${p.status}`; }
    root.dataset.updates = String(Number(root.dataset.updates || 0) + 1);
  });
  source.addEventListener("end", () => source.close());
}

function authHeaders() {
  const token = document.getElementById("token");
  return token && token.value ? { Authorization: `Bearer ${token.value}` } : {};
}

function runsPage() {
  document.querySelectorAll("tr[data-run]").forEach(live);
  document.querySelectorAll("button.cancel").forEach((button) => {
    button.addEventListener("click", async () => {
      const response = await fetch(`/api/v1/runs/${encodeURIComponent(button.dataset.run)}/cancel`,
        { method: "POST", headers: authHeaders() });
      button.textContent = response.ok ? "cancelling" : `error ${response.status}`;
      button.disabled = response.ok;
    });
  });
}

function histogram(values, bins) {
  if (!values.length) return { labels: [], counts: [] };
  const lo = Math.min(...values), hi = Math.max(...values);
  const width = Math.max(1, Math.ceil((hi - lo + 1) / bins));
  const counts = [];
  const labels = [];
  for (let start = lo; start <= hi; start += width) { labels.push(`${start}–${start + width - 1}`); counts.push(0); }
  values.forEach((v) => { counts[Math.floor((v - lo) / width)] += 1; });
  return { labels, counts };
}

function chart(id, config) {
  const canvas = document.getElementById(id);
  if (!canvas || !window.Chart) return;
  config.options = Object.assign({ responsive: true, maintainAspectRatio: false, animation: false }, config.options || {});
  new window.Chart(canvas, config);
}

function runPage() {
  document.querySelectorAll(".cards[data-run]").forEach(live);
  const data = document.getElementById("data");
  const series = JSON.parse(data.dataset.series);
  const trainer = JSON.parse(data.dataset.trainer);
  const finished = series.finished.filter((e) => e.t).sort((a, b) => (a.t < b.t ? -1 : 1));
  const graded = finished.filter((e) => e.reward !== null);
  const window_ = 8;
  chart("chart-reward-time", {
    type: "line",
    data: {
      labels: graded.map((e) => e.t.slice(11, 19)),
      datasets: [{ label: "reward (rolling mean)", data: graded.map((_, i) => {
        const part = graded.slice(Math.max(0, i - window_ + 1), i + 1);
        return part.reduce((a, e) => a + e.reward, 0) / part.length;
      }), pointRadius: 0 }],
    },
    options: { scales: { y: { min: 0, max: 1 } } },
  });
  const byVersion = {};
  graded.forEach((e) => { const v = e.version ?? 0; (byVersion[v] = byVersion[v] || []).push(e.reward); });
  const versions = Object.keys(byVersion).map(Number).sort((a, b) => a - b);
  chart("chart-reward-version", {
    type: "bar",
    data: {
      labels: versions.map((v) => `v${v}`),
      datasets: [
        { label: "reward mean", data: versions.map((v) => byVersion[v].reduce((a, b) => a + b, 0) / byVersion[v].length) },
        { label: "pass rate", data: versions.map((v) => byVersion[v].filter((r) => r === 1).length / byVersion[v].length) },
      ],
    },
    options: { scales: { y: { min: 0, max: 1 } } },
  });
  const turns = histogram(finished.map((e) => e.turns || 0), 20);
  chart("chart-length", { type: "bar", data: { labels: turns.labels, datasets: [{ label: "episodes", data: turns.counts }] } });
  const tokens = histogram(finished.map((e) => e.tokens || 0), 20);
  chart("chart-tokens", { type: "bar", data: { labels: tokens.labels, datasets: [{ label: "episodes", data: tokens.counts }] } });
  if (series.staleness && series.staleness.length) {
    const stale = histogram(series.staleness, 10);
    chart("chart-staleness", { type: "bar", data: { labels: stale.labels, datasets: [{ label: "groups", data: stale.counts }] } });
  }
  if (trainer.length) {
    chart("chart-trainer", {
      type: "line",
      data: {
        labels: trainer.map((m) => `v${m.version}`),
        datasets: ["loss", "mismatch_kl", "entropy", "masked_fraction"].map((k) => ({ label: k, data: trainer.map((m) => m[k]) })),
      },
    });
  }
  tableTools(document.getElementById("tasks"));
  trainingCharts();
}

// A training run: reward and eval pass@1 over versions, the policy's drift, the groups, the step time.
function trainingCharts() {
  const holder = document.getElementById("training");
  if (!holder) return;
  const t = JSON.parse(holder.dataset.training);
  const byStep = {};
  t.steps.forEach((s) => { byStep[s.version] = s; });
  const evals = {};
  t.evals.forEach((e) => { if (e.pass_at_1 !== null) evals[e.policy_version] = e; });
  const versions = Array.from(new Set([0, ...t.steps.map((s) => s.version), ...Object.keys(evals).map(Number)]))
    .sort((a, b) => a - b);
  const labels = versions.map((v) => `v${v}`);
  const pick = (k) => versions.map((v) => (byStep[v] ? byStep[v][k] : null));
  const ev = (f) => versions.map((v) => (evals[v] ? f(evals[v]) : null));
  chart("chart-train-reward", {
    type: "line",
    data: { labels, datasets: [
      { label: "reward (training step)", data: pick("reward_mean"), spanGaps: true },
      { label: "eval pass@1", data: ev((e) => e.pass_at_1), spanGaps: true },
      { label: "95% low", data: ev((e) => e.pass_at_1_ci[0]), borderDash: [4, 4], pointRadius: 0, spanGaps: true },
      { label: "95% high", data: ev((e) => e.pass_at_1_ci[1]), borderDash: [4, 4], pointRadius: 0, spanGaps: true },
    ] },
    options: { scales: { y: { min: 0, max: 1 } } },
  });
  chart("chart-train-policy", {
    type: "line",
    data: { labels, datasets: ["mismatch_kl", "entropy"].map((k) => ({ label: k, data: pick(k), spanGaps: true })) },
  });
  chart("chart-train-groups", {
    type: "line",
    data: { labels, datasets: [
      { label: "staleness (mean steps)", data: pick("staleness_mean"), spanGaps: true },
      { label: "useful-group fraction", data: pick("useful_fraction"), spanGaps: true },
      { label: "tasks filtered", data: pick("filtered"), spanGaps: true },
      { label: "groups dropped", data: pick("dropped_groups"), spanGaps: true },
    ] },
  });
  chart("chart-train-time", {
    type: "bar",
    data: { labels, datasets: [["wait_s", "waiting for rollouts"], ["step_s", "training"], ["publish_s", "publishing + reload"]]
      .map(([k, label]) => ({ label, data: pick(k) })) },
    options: { scales: { x: { stacked: true }, y: { stacked: true } } },
  });
  document.querySelectorAll("td.rate").forEach((td) => {
    if (td.dataset.rate !== "") td.style.backgroundColor = `rgba(21, 128, 61, ${0.08 + 0.6 * Number(td.dataset.rate)})`;
  });
  tableTools(document.getElementById("difficulty"));
}

// Sort by clicking a header; filter rows with #task-filter.
function tableTools(table) {
  if (!table) return;
  const body = table.tBodies[0];
  table.querySelectorAll("th[data-sort]").forEach((th, column) => {
    let ascending = true;
    th.addEventListener("click", () => {
      const numeric = th.dataset.sort === "num";
      const rows = Array.from(body.rows);
      rows.sort((a, b) => {
        const x = a.cells[column].textContent, y = b.cells[column].textContent;
        const cmp = numeric ? (parseFloat(x) || -1) - (parseFloat(y) || -1) : x.localeCompare(y);
        return ascending ? cmp : -cmp;
      });
      ascending = !ascending;
      rows.forEach((r) => body.appendChild(r));
    });
  });
  const filter = document.getElementById("task-filter");
  if (filter) {
    filter.addEventListener("input", () => {
      const needle = filter.value.toLowerCase();
      Array.from(body.rows).forEach((r) => { r.hidden = needle && !r.cells[0].textContent.toLowerCase().includes(needle); });
    });
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function renderTurn(t) {
  const li = el("li", "turn");
  li.id = `turn-${t.idx}`;
  li.tabIndex = -1;
  li.dataset.idx = String(t.idx);
  const head = el("div", "turn-head");
  const link = el("a", null, `turn ${t.idx}`);
  link.href = `#turn-${t.idx}`;
  head.appendChild(link);
  head.appendChild(el("span", "muted small",
    `v${fmt(t.policy_version)} · ${t.n_input_tokens} in / ${t.n_output_tokens} out · model ${fmt(t.generation_s, 2)} s · tool ${fmt(t.tool_s, 2)} s · ${t.finish_reason || ""}`));
  li.appendChild(head);
  if (t.redacted && t.redacted.length) {
    li.appendChild(el("p", "redacted", document.getElementById("turns").dataset.redacted));
    return li;
  }
  li.appendChild(el("pre", "assistant", t.text || ""));
  if (t.tool_call) li.appendChild(el("pre", "tool-call", JSON.stringify(t.tool_call, null, 1)));
  if (t.observation !== null && t.observation !== undefined) {
    const details = el("details", "observation");
    details.open = t.observation.length < 2000;
    details.appendChild(el("summary", null, `observation (${t.observation.length.toLocaleString("en")} chars)`));
    details.appendChild(el("pre", null, t.observation));
    li.appendChild(details);
  }
  return li;
}

function episodePage() {
  const nav = document.querySelector(".episode-nav");
  const list = document.getElementById("turns");
  const episode = nav.dataset.episode;
  let loaded = Number(nav.dataset.loaded);
  const total = Number(nav.dataset.turns);
  // one fetch at a time: the button's click and the observer seeing it can both ask at once
  let loading = null;
  function loadMore() {
    if (!loading) loading = fetchMore().finally(() => { loading = null; });
    return loading;
  }
  async function fetchMore() {
    if (loaded >= total) return false;
    const response = await fetch(`/api/v1/episodes/${encodeURIComponent(episode)}?turns_offset=${loaded}&turns_limit=100`);
    const body = await response.json();
    body.turns.forEach((t) => {
      const li = renderTurn(t);
      list.appendChild(li);
      if (shade && shade.checked) shadeTurn(li);
    });
    loaded += body.turns.length;
    const button = document.getElementById("more-turns");
    if (button && loaded >= total) button.remove();
    return body.turns.length > 0;
  }
  const button = document.getElementById("more-turns");
  if (button) button.addEventListener("click", loadMore);
  // load further turns as the reader approaches the end of the list
  if (window.IntersectionObserver && button) {
    new IntersectionObserver((entries) => { if (entries.some((e) => e.isIntersecting)) loadMore(); }).observe(button);
  }
  function turns() { return Array.from(list.querySelectorAll(".turn")); }
  function current() {
    const items = turns();
    const hash = window.location.hash.replace("#turn-", "");
    const at = items.findIndex((t) => t.dataset.idx === hash);
    return at;
  }
  async function go(delta) {
    let items = turns();
    let at = current() + delta;
    if (at >= items.length && await loadMore()) items = turns();
    at = Math.max(0, Math.min(items.length - 1, at));
    const target = items[at];
    if (!target) return;
    items.forEach((t) => t.classList.remove("current"));
    target.classList.add("current");
    history.replaceState(null, "", `#turn-${target.dataset.idx}`);
    target.focus({ preventScroll: true });
    target.scrollIntoView({ block: "start" });
  }
  document.addEventListener("keydown", (event) => {
    if (event.target.tagName === "INPUT" || event.metaKey || event.ctrlKey || event.altKey) return;
    if (event.key === "j") go(1);
    else if (event.key === "k") go(-1);
    else if (event.key === "n" && document.getElementById("next-episode")) window.location = document.getElementById("next-episode").href;
    else if (event.key === "p" && document.getElementById("prev-episode")) window.location = document.getElementById("prev-episode").href;
  });
  // logprob shading: each sampled token of a turn as its own span, darker when less likely
  const shade = document.getElementById("shade");
  async function shadeTurn(li) {
    if (li.dataset.shaded) return;
    li.dataset.shaded = "loading";
    const url = `/api/v1/episodes/${encodeURIComponent(episode)}/tokens?turn=${li.dataset.idx}`;
    let response = null;
    // a tokenizer still loading (409) or a server restarting (5xx, no answer) is tried again
    for (let attempt = 0; attempt < 5; attempt++) {
      if (attempt) await new Promise((done) => setTimeout(done, 250 * 2 ** attempt));
      try { response = await fetch(url); } catch (e) { response = null; continue; }
      if (response.ok || (response.status !== 409 && response.status < 500)) break;
    }
    if (!response || !response.ok) {  // unshaded; toggling the box again tries again
      li.dataset.shaded = "";
      li.dataset.shadeError = response ? String(response.status) : "no answer";
      return;
    }
    li.dataset.shaded = "yes";
    delete li.dataset.shadeError;
    const body = await response.json();
    const pre = el("pre", "assistant shaded");
    body.tokens.forEach((t) => {
      // a token that decodes to nothing alone (an id past the tokenizer's vocabulary, a special
      // token) is still a sampled token: shown by its id, so that it can be seen and hovered
      const span = t.text ? el("span", "tok", t.text) : el("span", "tok blank", `\u27e8${t.id}\u27e9`);
      const p = t.logprob === null ? 1 : Math.exp(t.logprob);
      span.style.backgroundColor = `rgba(220, 38, 38, ${(0.6 * (1 - p)).toFixed(3)})`;
      span.title = (t.logprob === null ? "no logprob" : `logprob ${t.logprob.toFixed(3)} (p ${p.toFixed(3)})`)
        + (t.text ? "" : `; token ${t.id} decodes to no text`);
      pre.appendChild(span);
    });
    const plain = li.querySelector("pre.assistant");
    plain.hidden = true;
    plain.after(pre);
  }
  if (shade) {
    shade.addEventListener("change", () => {
      turns().forEach((li) => {
        const shaded = li.querySelector("pre.shaded"), plain = li.querySelector("pre.assistant:not(.shaded)");
        if (shade.checked) { if (shaded) { shaded.hidden = false; plain.hidden = true; } else shadeTurn(li); }
        else if (shaded) { shaded.hidden = true; plain.hidden = false; }
      });
    });
  }
  function fromHash() {  // a deep link (#turn-N), on load or when the hash changes in place
    if (!window.location.hash.startsWith("#turn-")) return;
    const target = document.getElementById(window.location.hash.slice(1));
    if (!target) return;
    turns().forEach((t) => t.classList.remove("current"));
    target.classList.add("current");
    target.scrollIntoView({ block: "start" });
  }
  window.addEventListener("hashchange", fromHash);
  fromHash();
}

function suitePage() { tableTools(document.getElementById("tasks")); }

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "runs") runsPage();
  else if (page === "run") runPage();
  else if (page === "episode") episodePage();
  else if (page === "suite") suitePage();
  document.body.dataset.ready = "yes";
});
