"""The planted faults of ``make mutants``: each a promise of the README broken on purpose,
and the tests expected to catch it.

A fault is data: the file, its exact original text (found exactly once), the faulty text
put in its place, and the pytest node ids to run against it. docs/testing.md lists them
with what each breaks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]


SCRIPTS = "tests/test_scripts.py::"
CLIENT = "tests/test_client.py::"
SHARDING = "tests/test_sharding.py::"

FAULTS: tuple[Fault, ...] = (
    # -- named by the issue --------------------------------------------------------------
    Fault("reaper reaps shard 0 only", "batching/sharded.py",
          "        for q in self.shards:\n            one = q.reap(limit)",
          "        for q in self.shards[:1]:\n            one = q.reap(limit)",
          ("tests/test_sharding_workers.py::test_the_reaper_takes_back_expired_leases_on_every_shard",)),
    Fault("stream/map ignore max_in_flight", "producer/client.py",
          "while not exhausted and len(waiting) < max_in_flight:\n"
          "                    room = min(ENQUEUE_CHUNK, max_in_flight - len(waiting))",
          "while not exhausted and len(waiting) < MAX_IN_FLIGHT:\n"
          "                    room = ENQUEUE_CHUNK",
          (CLIENT + "test_stream_keeps_a_bounded_number_in_flight",
           CLIENT + "test_map_keeps_a_bounded_number_in_flight")),
    # -- scheduling ----------------------------------------------------------------------
    Fault("aging: class delay ignored (FIFO)", "batching/lua/enqueue.lua",
          "local rank = fmt_int(now + delay)", "local rank = fmt_int(now)",
          (SCRIPTS + "test_priority_classes_and_integer_delays_rank_as_documented",)),
    Fault("aging: strict priority, no aging", "batching/lua/enqueue.lua",
          "local rank = fmt_int(now + delay)", "local rank = fmt_int(now + delay * 1000)",
          (SCRIPTS + "test_priority_classes_and_integer_delays_rank_as_documented",)),
    Fault("token budget: padding not counted", "batching/lua/claim.lua",
          "if widest * (#chosen + 1) <= max_tokens then",
          "if widest <= max_tokens then",
          (SCRIPTS + "test_claim_keeps_padded_tokens_within_the_budget",
           "tests/test_policy.py::test_lua_claim_agrees_with_the_python_rule")),
    Fault("token budget: python rule", "batching/policy.py",
          "if widest * (len(chosen) + 1) <= max_batch_tokens:",
          "if longest * (len(chosen) + 1) <= max_batch_tokens:",
          ("tests/test_policy.py::test_budgets_hold_and_head_is_included",)),
    Fault("deadline: expired requests run", "batching/lua/claim.lua",
          "elseif expire ~= '0' and tonumber(expire) > 0 and tonumber(expire) <= now then",
          "elseif false then",
          (SCRIPTS + "test_deadlines_expire_queued_requests",)),
    Fault("fill from slower classes ignores --no-fill-from-slower", "batching/lua/claim.lua",
          "    if fill_from_slower or not slower then", "    if true then",
          (SCRIPTS + "test_no_fill_from_slower_leaves_the_room_empty_and_runs_at_once",)),
    Fault("a partial batch never waits (--max-wait-ms)", "batching/lua/claim.lua",
          "  if not full and waited < max_wait then", "  if false then",
          (SCRIPTS + "test_a_partial_batch_waits_for_company_up_to_max_wait",)),
    Fault("enqueue not idempotent by id", "batching/lua/enqueue.lua",
          "  if known(i, id) then", "  if seen[id] then",
          (SCRIPTS + "test_enqueue_is_idempotent_by_id_and_counts_depth",)),
    Fault("max_pending not enforced", "batching/lua/enqueue.lua",
          "+ rcall('ZCARD', K.delayed) + fresh > max_pending then",
          "+ rcall('ZCARD', K.delayed) + fresh > max_pending * 1000 then",
          (CLIENT + "test_queue_full_refuses_and_keeps_what_was_accepted",)),
    Fault("a claimed batch never yields to a more urgent request", "workers/claiming.py",
          "            if head is None or head >= min(r.rank for r in batch.requests):",
          "            if True:",
          ("tests/test_prefetch.py::test_a_prefetched_batch_yields_to_a_realtime_request",)),
    Fault("shards claimed without the rank ceiling", "batching/shard_claim.py",
          "            ceiling = others[0] + SHARD_SLACK_MS", "            ceiling = None",
          (SHARDING + "test_no_request_overtaken_across_shards",)),
    Fault("prefetched claims kept at SIGTERM", "workers/loop.py",
          "            if leftovers:\n", "            if False:\n",
          ("tests/test_reliability.py::test_sigterm_finishes_the_batch_and_returns_prefetched_claims",)),
    # -- leases, cancel, dead letters, back-off ------------------------------------------
    Fault("lease renewal renews nothing", "workers/leases.py",
          "self.queue.renew(self.worker_id, self.leases.snapshot())",
          "self.queue.renew(self.worker_id, [])",
          ("tests/test_reliability.py::test_a_batch_longer_than_its_lease_runs_once",)),
    Fault("cancel: a running request runs on", "batching/lua/cancel.lua",
          "local token = rcall('HGET', K.owner, id)", "local token = nil",
          (SCRIPTS + "test_cancel_queued_and_running",
           "tests/test_reliability.py::test_cancelling_a_running_request_discards_its_output")),
    Fault("dead-letter retry keeps the spent attempts", "batching/lua/revive.lua",
          "    rcall('HDEL', K.attempts, id)\n", "",
          (SCRIPTS + "test_fail_backs_off_then_dead_letters_and_revive_purge",)),
    Fault("dead-letter retry does not queue", "batching/lua/revive.lua",
          "    requeue(K.pending, id, s, counts)\n", "",
          (SCRIPTS + "test_fail_backs_off_then_dead_letters_and_revive_purge",)),
    Fault("retry back-off has no 60 s cap", "batching/lua/fail.lua",
          "local wait = math.min(cap_ms, base_ms * math.pow(2, failures - 1))",
          "local wait = base_ms * math.pow(2, failures - 1)",
          (SCRIPTS + "test_retry_back_off_doubles_up_to_sixty_seconds",)),
    # -- results and streams ---------------------------------------------------------------
    Fault("delivered results are kept", "producer/replies.py",
          "        ids = [r.id for r in results if r.status not in (DEAD, CANCELLED)]\n"
          "        if ids and self._on_delivered is not None:\n            try:\n"
          "                self._on_delivered(ids)",
          "        ids = [r.id for r in results if r.status not in (DEAD, CANCELLED)]\n"
          "        if ids and self._on_delivered is not None:\n            try:\n"
          "                pass",
          ("tests/test_memory.py::test_delivered_results_are_deleted_unless_the_queue_keeps_them",)),
    Fault("streams are not trimmed", "batching/streams.py",
          "pipe.xadd(key, fields, maxlen=MAXLEN, approximate=True)", "pipe.xadd(key, fields)",
          (SCRIPTS + "test_a_stream_is_trimmed_and_expires",)),
    Fault("streams never expire", "batching/streams.py",
          "            if expire:\n                pipe.expire(key, TTL_S)\n", "",
          (SCRIPTS + "test_a_stream_is_trimmed_and_expires",)),
    # -- offline jobs, workers ---------------------------------------------------------------
    Fault("job resume reruns written lines", "producer/jobs/run.py",
          "written=number in written)", "written=False)",
          ("tests/test_jobs.py::test_killed_jobs_worker_resumes_without_duplicates",)),
    Fault("job status --watch exits 0 on failure", "producer/jobs/cli.py",
          "        ctx.exit(NotOk.exit_code)", "        ctx.exit(0)",
          ("tests/test_jobs.py::test_job_status_watch_exits_7_when_the_job_is_cancelled",)),
    Fault("calibration keeps the fastest size", "workers/calibrate.py",
          "    return min(s for s, r in rates.items() if r >= (1 - TOLERANCE) * best)",
          "    return max(rates, key=rates.__getitem__)",
          ("tests/test_runners.py::test_calibration_chooses_the_smallest_size_within_five_percent",
           "tests/test_runners.py::test_calibration_keeps_the_smallest_batch_within_five_percent_of_the_best")),
    Fault("calibration ignores the token budget", "workers/calibrate.py",
          "if size > most or (rates and size * length > max_batch_tokens):",
          "if size > most:",
          ("tests/test_runners.py::test_calibration_keeps_the_smallest_batch_within_five_percent_of_the_best",)),
    Fault("generation keeps unstarted claims at SIGTERM", "workers/decode_loop.py",
          "fresh = [s for s in self.waiting if not s.key.started]", "fresh = []",
          ("tests/test_generation.py::test_stop_hands_back_claimed_requests_not_started",)),
    # -- sharding ------------------------------------------------------------------------
    Fault("idle sharded worker waits on shard 0 only", "batching/shard_claim.py",
          "self.client.blpop([q.keys.wake for q in shards], timeout=timeout_s)",
          "self.client.blpop([shards[0].keys.wake], timeout=timeout_s)",
          ("tests/test_sharding_workers.py::test_idle_worker_wakes_for_any_shard_on_one_redis",)),
    Fault("cluster wake watch on shard 0 only", "batching/wake_watch.py",
          "        for shard in shards:\n            thread = self._threads.get(shard.keys.wake)",
          "        for shard in shards[:1]:\n            thread = self._threads.get(shard.keys.wake)",
          (SHARDING + "test_idle_worker_wakes_for_any_shard",)),
    # -- metrics, tracing, dashboard, CLI ----------------------------------------------------
    Fault("repriced counts claims, not requests", "workers/claiming.py",
          "metrics.REPRICED.inc(len(exact))", "metrics.REPRICED.inc()",
          ("tests/test_worker.py::test_a_worker_prices_estimated_requests_exactly_before_choosing_a_batch",)),
    Fault("max_batch_size metric not the size in force", "workers/cli.py",
          "metrics.MAX_BATCH_SIZE.set(max_batch_size)", "metrics.MAX_BATCH_SIZE.set(64)",
          ("tests/test_metrics.py::test_metric_values_after_a_known_sequence",)),
    Fault("OTEL_SDK_DISABLED ignored", "batchery/tracing.py",
          'if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporters',
          "if exporters",
          ("tests/test_tracing_setup.py::test_otel_environment_names_the_service_and_can_disable_it",)),
    Fault("service name not batchery-COMMAND", "batchery/tracing.py",
          'resource_attributes={} if named else {"service.name": service}',
          "resource_attributes={}",
          ("tests/test_tracing_setup.py::test_otel_environment_names_the_service_and_can_disable_it",)),
    Fault("application's tracer provider ignored", "batchery/tracing.py",
          "provider = _provider or trace.get_tracer_provider()", "provider = _provider",
          ("tests/test_tracing_setup.py::test_an_applications_own_tracer_provider_gets_the_spans",)),
    Fault("dashboard: no paused alert", "dashboard/state.py",
          "        if q[\"paused\"]:\n", "        if False:\n",
          ("tests/test_dashboard.py::test_alerts_say_paused_queues_and_failed_jobs",)),
    Fault("dashboard: no failed-job alert", "dashboard/state.py",
          'if job["state"] == jobs.FAILED and _within(job.get("ended_at"), RECENT_FAILURE_S):',
          "if False:",
          ("tests/test_dashboard.py::test_alerts_say_paused_queues_and_failed_jobs",)),
    Fault("--json read from the environment", "batchery/cli_shared.py",
          'return click.option("--json", "as_json", is_flag=True, allow_from_autoenv=False,',
          'return click.option("--json", "as_json", is_flag=True,',
          ("tests/test_cli_structure.py::test_json_id_and_all_never_come_from_the_environment",)),
    Fault("--all read from the environment", "batchery/queue_cli.py",
          'return click.option("--all", "everything", is_flag=True, allow_from_autoenv=False,',
          'return click.option("--all", "everything", is_flag=True,',
          ("tests/test_cli_structure.py::test_json_id_and_all_never_come_from_the_environment",)),
    Fault("--id read from the environment", "producer/cli.py",
          '@click.option("--id", "request_id", allow_from_autoenv=False,',
          '@click.option("--id", "request_id",',
          ("tests/test_cli_structure.py::test_json_id_and_all_never_come_from_the_environment",)),
)
