"""Fair sharing with a real worker: two teams submit six jobs each, team-a first; one worker serves them in turns."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

JOBS_PER_TEAM = 6


def test_two_teams_are_served_alternately_not_first_come_first_served(settings, worker_env, start_worker,
                                                                        tiny_bert_dir):
    # One quantum wider than the whole test: the teams' device time stays comparable, so they take strict turns.
    worker_env["TRAINSERVE_FAIR_SHARE_QUANTUM_S"] = "3600"
    settings.fair_share_quantum_s = 3600
    with TestClient(create_app(settings=settings)) as api:  # the real Celery queue
        keys = {team: f"Bearer {make_key(settings.resolved_database_url, tenant=team)}"
                for team in ("team-a", "team-b")}
        submitted: dict[str, list[str]] = {}
        for team, key in keys.items():  # team-a submits all six before team-b submits any
            api.headers["Authorization"] = key
            dataset = upload(api, tsv_bytes(sentiment_rows())).json()["id"]
            submitted[team] = []
            for _ in range(JOBS_PER_TEAM):
                response = api.post("/jobs", json={
                    "base_model": str(tiny_bert_dir), "train_dataset": dataset, "text_column": "sentence",
                    "hyperparameters": {"max_steps": 2, "batch_size": 8, "max_length": 16}})
                assert response.status_code == 201, response.text
                submitted[team].append(response.json()["id"])

        # Before any worker: team-b's first job is second in line, team-a's third is fifth (a b a b a).
        first_b = api.get(f"/jobs/{submitted['team-b'][0]}").json()
        assert (first_b["queue_position"], first_b["waiting_reason"]) == (
            2, "behind 1 job of teams whose turn comes first")
        api.headers["Authorization"] = keys["team-a"]
        third_a = api.get(f"/jobs/{submitted['team-a'][2]}").json()
        assert (third_a["queue_position"], third_a["waiting_reason"]) == (
            5, "behind 2 jobs of your team and 2 of other teams taking turns")

        start_worker()

        def finished() -> list[dict] | None:
            jobs = []
            for team, ids in submitted.items():
                api.headers["Authorization"] = keys[team]
                jobs += [api.get(f"/jobs/{job_id}").json() for job_id in ids]
            assert all(j["status"] in ("queued", "running", "succeeded") for j in jobs), jobs
            return jobs if all(j["status"] == "succeeded" for j in jobs) else None

        jobs = wait_for(finished, 240, "all twelve jobs to succeed")

    team_of = {job_id: team for team, ids in submitted.items() for job_id in ids}
    started = sorted(jobs, key=lambda j: j["started_at"])
    order = [team_of[j["id"]] for j in started]
    # On a failure, say how each started: a second attempt or a late claim shows here.
    assert order == ["team-a", "team-b"] * JOBS_PER_TEAM, [(team_of[j["id"]], j["started_at"], j["attempts"])
                                                           for j in started]
    for team, ids in submitted.items():  # within a team, oldest first (equal priority)
        started = {j["id"]: j["started_at"] for j in jobs}
        assert [started[i] for i in ids] == sorted(started[i] for i in ids), team
