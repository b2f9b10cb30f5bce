"""ops/feature_counts: the process-wide table of what each feature ran, fell back on, and moved."""

import threading

from hf_ddpfix.ops import feature_counts as fc


def test_counts_add_up_per_feature_and_reason_and_reset_clears_them():
    fc.reset()
    fc.record_ran("tiled_mlp", 3)
    fc.record_ran("tiled_mlp")
    fc.record_fallback("tiled_mlp", "stock: keyword arguments ['cache']", 2)
    fc.record_fallback("tiled_mlp", "stock: keyword arguments ['cache']")
    fc.record_amount("offload", "bytes", 10)
    fc.record_amount("offload", "bytes", 5)
    snap = fc.snapshot()
    assert snap["tiled_mlp"].ran == 4
    assert snap["tiled_mlp"].fallbacks == {"stock: keyword arguments ['cache']": 3}
    assert snap["tiled_mlp"].fell_back == 3
    assert fc.as_metrics() == {"hf_ddpfix/offload/ran": 0, "hf_ddpfix/offload/fell_back": 0,
                               "hf_ddpfix/offload/bytes": 15, "hf_ddpfix/tiled_mlp/ran": 4,
                               "hf_ddpfix/tiled_mlp/fell_back": 3}
    fc.record_ran("tiled_mlp")
    assert snap["tiled_mlp"].ran == 4  # a snapshot is a copy
    fc.reset()
    assert fc.snapshot() == {} and fc.as_metrics() == {}


def test_counting_from_several_threads_loses_nothing():
    fc.reset()

    def work():
        for _ in range(1000):
            fc.record_ran("offload")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fc.snapshot()["offload"].ran == 4000
    fc.reset()
