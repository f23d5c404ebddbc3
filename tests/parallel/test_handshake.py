"""The handshake in `surgery.parallel.agreement.all_ranks_called` (issue 18): a verb called on some ranks only raises within
the timeout, naming the ranks that did not come, and the next call on every rank meets again. Two threads play two
ranks over one in-memory store (the spawned TP save test runs the same through gloo)."""

import threading
import time
import unittest
from types import SimpleNamespace
from unittest import mock

import torch.distributed as dist

import surgery
from surgery.parallel import agreement


class TwoRanks:
    def __init__(self):
        self.store = dist.HashStore()
        self.local = threading.local()

    def __enter__(self):
        group = SimpleNamespace(group_name="test")
        self.patches = [
            mock.patch.object(agreement, "_group", lambda where: (group, 2)),
            mock.patch.object(dist.distributed_c10d, "_get_default_store", lambda: self.store),
            mock.patch.object(agreement.dist, "get_rank", lambda group=None: self.local.rank),
        ]
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self.patches):
            patch.stop()

    def call(self, ranks, timeout):
        """`all_ranks_called` on each of `ranks` (threads); returns each rank's (error or None, seconds)."""
        out = {}

        def run(rank):
            self.local.rank = rank
            start = time.monotonic()
            try:
                agreement.all_ranks_called(None, "save_pretrained", timeout)
                out[rank] = (None, time.monotonic() - start)
            except surgery.SurgeryError as error:
                out[rank] = (str(error), time.monotonic() - start)

        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join((timeout or 30) + 30)
        return out


class Handshake(unittest.TestCase):
    def test_one_rank_alone_raises_in_time_and_the_next_call_meets_again(self):
        with TwoRanks() as ranks:
            self.assertEqual({r: e for r, (e, _) in ranks.call([0, 1], 5).items()}, {0: None, 1: None})
            alone = ranks.call([0], 0.5)
            error, seconds = alone[0]
            self.assertRegex(error, r"^surgery.save_pretrained: rank 1 did not call surgery.save_pretrained within "
                                    r"0.5 s \(rank 0 did\). Every rank of the group must call it at the same point")
            self.assertLess(seconds, 10)
            for _ in range(2):  # the slot moved on: both ranks meet in a fresh one, every time after
                self.assertEqual({r: e for r, (e, _) in ranks.call([0, 1], 5).items()}, {0: None, 1: None})

    def test_the_timeout_is_the_users(self):
        with mock.patch.dict("os.environ", {"SURGERY_HANDSHAKE_TIMEOUT": "0.25"}):
            self.assertEqual(agreement.handshake_timeout(), 0.25)
            with TwoRanks() as ranks:
                error, _ = ranks.call([1], None)[1]
                self.assertRegex(error, r"rank 0 did not call surgery.save_pretrained within 0.25 s \(rank 1 did\)")
        with mock.patch.dict("os.environ", {"SURGERY_HANDSHAKE_TIMEOUT": "soon"}), \
                self.assertRaisesRegex(surgery.SurgeryError, r"SURGERY_HANDSHAKE_TIMEOUT='soon': give a number"):
            agreement.handshake_timeout()
        self.assertEqual(agreement.handshake_timeout(), 30.0)


if __name__ == "__main__":
    unittest.main()
