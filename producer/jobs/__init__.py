"""Offline jobs on RQ: a JSONL file of requests in, a JSONL file of results out.

- spec.py: what a job is (its spec, progress and states);
- files.py: the input read and validated line by line, the result and error files;
- run.py: one run of a job (the RQ job function), resuming what earlier runs left;
- bookkeeping.py: submit, look up, list and cancel jobs;
- worker.py: the RQ worker class that runs them (`batchery job worker`);
- cli.py: the `batchery job` commands.
"""
