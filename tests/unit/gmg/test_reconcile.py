"""The GMG's start-up reconciliation and stream expiry as pure decisions: what a changed config removes from the
stored state, what it keeps, and which running workers make it refuse."""
from __future__ import annotations

from shared.config import parse_cluster, parse_tenants
from shared.gmg.keys import GMGKeys
from shared.gmg.store import model_id, segment_bytes
from services.gmg.reconcile import (Desired, ReconcileOptions, StoredState, StreamInfo, classify_stream,
                                    expired_streams, plan_reconcile)

P = "t:"
K = GMGKeys(P)
CLUSTER3 = parse_cluster({"devices": [{"id": d, "backend": "cpu", "memory_bytes": 100_000_000}
                                      for d in ("d0", "d1", "d2")]}, "cluster.yaml")
CLUSTER2 = parse_cluster({"devices": [{"id": d, "backend": "cpu", "memory_bytes": 100_000_000}
                                      for d in ("d0", "d1")]}, "cluster.yaml")


def tenants(*specs) -> object:
    return parse_tenants({"tenants": [{"name": n, "model": m, "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": h}
                                      for n, m, h in specs]}, "tenants.yaml")


OLD = tenants(("a", {"preset": "tiny-2l", "seed": 1}, ["d0"]), ("b", "tiny-2l", ["d1"]), ("c", "tiny-2l", ["d2"]))


def stored(cluster, tns) -> StoredState:
    """What a mesh on (cluster, tns) leaves in Redis: registry, home residency and weights, a staged copy of
    a's mlp[0] on d1 leased to a, a running and an ended request on d0, stats and simulator fields."""
    st = StoredState()
    for d in cluster.devices:
        st.devices.add(d.id)
        st.gmg_keys += [K.device(d.id), K.reservations(d.id), K.resident(d.id), K.exec_state(d.id)]
        st.reservations[d.id], st.resident[d.id], st.pins[d.id] = {}, {}, {}
        st.forecasts.append(d.id)
        st.corrections_fields.append(f"{d.id}/mlp")
    for t in tns.tenants:
        st.tenants.add(t.name)
        st.gmg_keys += [K.tenant(t.name), K.model_graph(t.name)]
        st.tenant_rows[t.name] = {"name": t.name, "model_id": model_id(t.model)}
        seg = segment_bytes(t.model.config)
        for d in t.home_devices:
            st.resident[d].update({f"{t.name}|{s}": str(n) for s, n in seg.items()})
            st.reservations[d][f"weights:{t.name}:home"] = f"weights|{t.name}|{sum(seg.values())}|1.0"
        st.tenant_stats.append(t.name)
        st.rates_fields += [t.name, f"{t.name}:mean_input", f"{t.name}:mean_output"]
    st.rates_fields += ["ts", "window_s"]
    mlp = segment_bytes(tns.get("a").model.config)["mlp[0]"]
    st.resident["d1"]["a|mlp[0]"] = str(mlp)
    st.reservations["d1"]["weights:a:mlp[0]"] = f"weights|a|{mlp}|1.0"
    st.reservations["d1"]["lease:L1"] = "lease|a|1000|1.0"
    st.pins["d1"]["a|mlp[0]"] = "1"
    st.lease_index["d1"] = ["L1"]
    st.leases["L1"] = {"id": "L1", "tenant": "a", "guest": "d1", "home": "d0", "segments": "mlp[0]",
                       "state": "active"}
    st.gmg_keys += [K.lease("L1"), K.leases("d1"), K.pins("d1")]
    st.reservations["d0"].update({"kv:r-run": "kv|a|500|1.0", "kv:r-done": "kv|a|500|1.0"})
    st.running["d0"] = {"r-run": "a|running|1.0", "r-done": "a|running|1.0"}
    st.journeys = {"r-run": "running", "r-done": "done"}
    return st


def test_unchanged_config_changes_nothing_but_ended_requests():
    st = stored(CLUSTER3, OLD)
    plan = plan_reconcile(st, Desired.from_config(CLUSTER3, OLD), K)
    assert not plan.conflicts and not plan.removed_devices and not plan.removed_tenants and not plan.changed_models
    assert plan.release == [("d0", "kv:r-done", "request ended")]  # the KV of a request that ended stays no longer
    assert plan.hdel == {K.requests("d0"): ["r-done"]}
    assert not plan.close_leases and not plan.delete and not plan.tenant_stats and not plan.rates_fields
    st.reservations["d0"].pop("kv:r-done")
    st.running["d0"].pop("r-done")
    assert plan_reconcile(st, Desired.from_config(CLUSTER3, OLD), K).empty()


def test_removed_tenant_and_device_leave_nothing_behind():
    new = tenants(("a", {"preset": "tiny-2l", "seed": 1}, ["d0"]), ("n", "tiny", ["d1"]))  # b removed, n added
    st = stored(CLUSTER3, OLD)
    plan = plan_reconcile(st, Desired.from_config(CLUSTER2, new), K)
    assert plan.removed_tenants == ["b", "c"] and plan.removed_devices == ["d2"] and not plan.changed_models
    assert {K.tenant("b"), K.model_graph("b"), K.tenant("c"), K.model_graph("c")} <= set(plan.delete)
    assert {K.device("d2"), K.reservations("d2"), K.resident("d2"), K.exec_state("d2")} <= set(plan.delete)
    assert plan.srem == {K.devices: ["d2"], K.tenants: ["b", "c"]}
    assert ("d1", "weights:b:home", "tenant removed") in plan.release
    assert sorted(plan.hdel[K.resident("d1")]) == sorted(f for f in st.resident["d1"] if f.startswith("b|"))
    assert plan.tenant_stats == ["b", "c"] and plan.forecasts == ["d2"] and plan.corrections_fields == ["d2/mlp"]
    assert plan.rates_fields == sorted(["b", "b:mean_input", "b:mean_output", "c", "c:mean_input", "c:mean_output"])
    # a's staged copy and lease on d1 stay: a, d0 and d1 are still configured and a's model is the same
    assert not plan.close_leases and not any(o in ("weights:a:mlp[0]", "lease:L1") for _, o, _ in plan.release)
    assert "a|mlp[0]" not in plan.hdel[K.resident("d1")] and K.pins("d1") not in plan.hdel


def test_changed_model_drops_staged_copies_and_leases_but_not_the_home():
    new = tenants(("a", {"preset": "tiny-2l", "seed": 7}, ["d0"]), ("b", "tiny-2l", ["d1"]), ("c", "tiny-2l", ["d2"]))
    plan = plan_reconcile(stored(CLUSTER3, OLD), Desired.from_config(CLUSTER3, new), K)
    assert plan.changed_models == ["a"] and not plan.removed_tenants
    assert plan.close_leases == [("L1", "model changed")]  # the close frees lease:L1 and unpins
    assert ("d1", "weights:a:mlp[0]", "model changed") in plan.release
    assert not any(o == "lease:L1" for _, o, _ in plan.release)
    assert plan.hdel[K.resident("d1")] == ["a|mlp[0]"] and plan.hdel[K.pins("d1")] == ["a|mlp[0]"]
    assert not any(o == "weights:a:home" for _, o, _ in plan.release)  # the worker resizes its own reservation


def test_home_moved_releases_the_old_home():
    new = tenants(("a", {"preset": "tiny-2l", "seed": 1}, ["d2"]), ("b", "tiny-2l", ["d1"]), ("c", "tiny-2l", ["d0"]))
    plan = plan_reconcile(stored(CLUSTER3, OLD), Desired.from_config(CLUSTER3, new), K)
    assert ("d0", "weights:a:home", "not the tenant's home") in plan.release
    assert ("d2", "weights:c:home", "not the tenant's home") in plan.release
    assert all(f.startswith("a|") for f in plan.hdel[K.resident("d0")])
    assert len(plan.hdel[K.resident("d0")]) == len(segment_bytes(OLD.get("a").model.config))


def test_running_workers_of_the_old_config_are_conflicts():
    new = tenants(("a", {"preset": "tiny-2l", "seed": 1}, ["d0"]), ("n", "tiny", ["d1"]))
    st = stored(CLUSTER3, OLD)
    st.workers = {"d0": {"pid": "10", "tenant": "a"}, "d1": {"pid": "11", "tenant": "b"},
                  "d2": {"pid": "12", "tenant": "c"}}
    plan = plan_reconcile(st, Desired.from_config(CLUSTER2, new), K)
    assert len(plan.conflicts) == 2, plan.conflicts
    assert "device 'd1'" in plan.conflicts[0] and "tenant 'b'" in plan.conflicts[0] and "'n'" in plan.conflicts[0]
    assert "device 'd2' is not in cluster.yaml" in plan.conflicts[1] and "pid 12" in plan.conflicts[1]
    st.workers = {"d0": {"pid": "10", "tenant": "a"}, "d1": {"pid": "13", "tenant": "n"}}  # new-config workers
    assert not plan_reconcile(st, Desired.from_config(CLUSTER2, new), K).conflicts


def test_tenant_rows_without_a_model_id_compare_the_weight_bytes():
    st = stored(CLUSTER3, OLD)
    for t in OLD.tenants:
        st.tenant_rows[t.name] = {"name": t.name, "weight_bytes": str(t.model.config.weight_bytes())}
    assert not plan_reconcile(st, Desired.from_config(CLUSTER3, OLD), K).changed_models
    st.tenant_rows["b"]["weight_bytes"] = "1"
    assert plan_reconcile(st, Desired.from_config(CLUSTER3, OLD), K).changed_models == ["b"]


def test_keys_outside_the_registry_sets_are_found():
    st = stored(CLUSTER2, tenants(("a", "tiny", ["d0"]), ("b", "tiny", ["d1"])))
    st.gmg_keys += [K.busy("ghost"), K.tenant("gone")]  # a device / tenant missing from the sets
    plan = plan_reconcile(st, Desired.from_config(CLUSTER2, tenants(("a", "tiny", ["d0"]), ("b", "tiny", ["d1"]))), K)
    assert plan.removed_devices == ["ghost"] and plan.removed_tenants == ["gone"]
    assert K.busy("ghost") in plan.delete and K.tenant("gone") in plan.delete
    assert K.devices not in plan.srem and K.tenants not in plan.srem


def test_stream_expiry():
    now = 1000.0
    p = "x:"
    assert classify_stream("x:tokens:gw-1", p) == ("tokens", "gw-1")
    assert classify_stream("x:worker:d9", p) == ("worker", "d9")
    assert classify_stream("x:sim:reply:c1", p) == ("reply", "c1")
    assert classify_stream("x:requests", p) == ("", "") and classify_stream("x:events", p) == ("", "")
    streams = [StreamInfo("x:tokens:dead", "tokens", "dead", now - 20), StreamInfo("x:tokens:live", "tokens", "live", 0),
               StreamInfo("x:tokens:recent", "tokens", "recent", now - 1),
               StreamInfo("x:worker:d0", "worker", "d0", 0), StreamInfo("x:worker:d9", "worker", "d9", 0),
               StreamInfo("x:worker:d8", "worker", "d8", 0), StreamInfo("x:sim:reply:c", "reply", "c", now - 11)]
    gone = expired_streams(streams, live_gateways={"live"}, live_workers={"d8"}, devices={"d0"}, now=now,
                           expiry_s=10)
    assert gone == ["x:tokens:dead", "x:worker:d9", "x:sim:reply:c"]


def test_options_from_the_environment():
    o = ReconcileOptions.from_env({"SLICESCHED_STREAM_EXPIRY_S": "2", "SLICESCHED_RECONCILE_WAIT_S": "0"})
    assert o.stream_expiry_s == 2 and o.wait_s == 0 and o.expiry_check_s == 1
    assert ReconcileOptions.from_env({}) == ReconcileOptions()
