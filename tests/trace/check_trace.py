#!/usr/bin/env python3
"""Checks a run's timeline traces (out_dir/trace/): every file is trace-event
JSON; spans nest on every thread (no partial overlap); for every communicator
of the mesh, the calls the communicator issued during the window (its
sequence numbers, recorded in otherData.comms) appear in the trace exactly once
as an issue and once as an execution, and every member of the group traced the
same (seq, op); merged.json has one process per rank with all their events.
usage: check_trace.py TRACE_DIR WORLD_SIZE [--expect pipeline|zero|offload|checkpoint|recompute|tp]...
"""
import json
import os
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def ns(value):
    return round(float(value) * 1000)


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: not JSON: {e}")
    events = doc.get("traceEvents")
    if not isinstance(events, list) or not events:
        fail(f"{path}: no traceEvents list")
    for e in events:
        for key in ("ph", "pid", "tid", "name"):
            if key not in e:
                fail(f"{path}: event without {key}: {e}")
        if e["ph"] not in "XiMbeC":
            fail(f"{path}: unknown phase {e['ph']}")
        if e["ph"] != "M" and not isinstance(e.get("ts"), (int, float)):
            fail(f"{path}: event without a numeric ts: {e}")
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            fail(f"{path}: span without a dur >= 0: {e}")
        if e["ph"] in "be" and "id" not in e:
            fail(f"{path}: async event without id: {e}")
    return doc


def check_nesting(path, events):
    by_thread = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["name"]))
    for (pid, tid), spans in by_thread.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for begin, end, name in spans:
            while stack and stack[-1][1] <= begin:
                stack.pop()
            if stack and end > stack[-1][1]:
                fail(f"{path}: pid {pid} tid {tid}: '{name}' [{begin}, {end}] ns overlaps "
                     f"'{stack[-1][2]}' [{stack[-1][0]}, {stack[-1][1]}] without nesting in it")
            stack.append((begin, end, name))
    # Async spans: every begin has its end.
    opened = {}
    for e in events:
        if e["ph"] in "be":
            key = (e["pid"], e["cat"], e["id"])
            opened[key] = opened.get(key, 0) + (1 if e["ph"] == "b" else -1)
    if any(v != 0 for v in opened.values()):
        fail(f"{path}: async spans without their end: {[k for k, v in opened.items() if v]}")


def members(group):
    inside = group[group.index("[") + 1:-1]
    return [int(r) for r in inside.split(",") if r]


def comm_calls(doc, rank):
    """{group: {seq: op}} of the issues and of the executions this rank traced."""
    issued, executed = {}, {}
    for e in doc["traceEvents"]:
        cat = e.get("cat")
        if cat not in ("comm issue", "comm", "p2p") or e["ph"] == "e":
            continue
        args = e.get("args", {})
        table = issued if cat == "comm issue" else executed
        calls = table.setdefault(args["group"], {})
        if args["seq"] in calls:
            fail(f"rank {rank}: {args['group']} seq {args['seq']} traced twice as {cat}")
        calls[args["seq"]] = e["name"]
    return issued, executed


def main():
    trace_dir, world = sys.argv[1], int(sys.argv[2])
    expect = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--expect"]
    ranks = []
    for r in range(world):
        path = os.path.join(trace_dir, f"rank_{r}.json")
        doc = load(path)
        check_nesting(path, doc["traceEvents"])
        if doc["otherData"]["rank"] != r or doc["otherData"]["world_size"] != world:
            fail(f"{path}: otherData names rank {doc['otherData']['rank']} of {doc['otherData']['world_size']}")
        ranks.append(doc)

    # Every call of the window, on every rank, and the same on every member.
    by_group = {}
    for r, doc in enumerate(ranks):
        issued, executed = comm_calls(doc, r)
        windows = doc["otherData"]["comms"]
        if world > 1 and not windows:
            fail(f"rank {r}: no communicators in otherData.comms")
        for w in windows:
            want = set(range(w["seq_begin"], w["seq_end"]))
            for what, table in (("issued", issued), ("executed", executed)):
                got = set(table.get(w["group"], {}))
                if got != want:
                    fail(f"rank {r}: {w['group']}: the communicator issued seq {sorted(want)} in the "
                         f"window, the trace has {what} {sorted(got)}")
            if r not in members(w["group"]):
                fail(f"rank {r}: not a member of its own group {w['group']}")
            by_group.setdefault(w["group"], {})[r] = issued.get(w["group"], {})
        for group in issued:
            if group not in {w["group"] for w in windows}:
                fail(f"rank {r}: calls on {group}, a communicator not in otherData.comms")
    checked = 0
    for group, per_rank in by_group.items():
        if sorted(per_rank) != members(group):
            fail(f"{group}: traced by ranks {sorted(per_rank)}, its members are {members(group)}")
        first = per_rank[members(group)[0]]
        for r, calls in per_rank.items():
            if calls != first:
                diff = sorted(set(calls.items()) ^ set(first.items()))[:5]
                fail(f"{group}: rank {r}'s calls differ from rank {members(group)[0]}'s: {diff}")
        checked += len(first)

    # The merged file: one process per rank, with each rank's events.
    merged = load(os.path.join(trace_dir, "merged.json"))
    check_nesting("merged.json", merged["traceEvents"])
    pids = {e["pid"] for e in merged["traceEvents"]}
    if pids != set(range(world)):
        fail(f"merged.json: processes {sorted(pids)}, expected ranks 0..{world - 1}")
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    if names != {r: f"rank {r}" for r in range(world)}:
        fail(f"merged.json: process names {names}")
    for r, doc in enumerate(ranks):
        mine = sum(1 for e in merged["traceEvents"] if e["pid"] == r)
        if mine != len(doc["traceEvents"]):
            fail(f"merged.json: rank {r} has {mine} events, its file {len(doc['traceEvents'])}")
    offsets = merged["otherData"]["clock"]["ranks"]
    if [o["rank"] for o in offsets] != list(range(world)):
        fail("merged.json: clock offsets are not one per rank")

    # What the run's layout must show on every rank.
    def has(doc, cat, prefix):
        return any(e.get("cat") == cat and e["name"].startswith(prefix) for e in doc["traceEvents"])
    needs = {
        "pipeline": [("pipeline", "F "), ("pipeline", "B ")],
        "zero": [("zero", "gather issue"), ("zero", "gather wait")],
        "offload": [("offload", "read"), ("offload", "write")],
        "checkpoint": [("checkpoint", "checkpoint write")],
        "recompute": [("recompute", "recompute layer")],
        "layers": [("forward", "layer"), ("backward", "layer"), ("step", "optimizer"), ("data", "data wait")],
    }
    for name in expect + ["layers"]:
        for r, doc in enumerate(ranks):
            for cat, prefix in needs[name]:
                if not has(doc, cat, prefix):
                    fail(f"rank {r}: no '{prefix}' span of category {cat} ({name})")
    if "pipeline" in expect:
        for r, doc in enumerate(ranks):
            for e in doc["traceEvents"]:
                if e.get("cat") == "pipeline" and e["name"][0] in "FB":
                    if not {"micro_batch", "chunk"} <= set(e.get("args", {})):
                        fail(f"rank {r}: pipeline action without micro_batch and chunk: {e}")
    print(f"trace ok: {world} ranks, {checked} collective calls matched over {len(by_group)} groups, "
          f"expected {expect + ['layers']}")


if __name__ == "__main__":
    main()
