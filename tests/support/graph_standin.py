"""A stand-in for engine.worker.cuda_graphs.GraphedRounds on the CPU: the lockstep path of a TP=2 engine
(`Executor._launch_lockstep`: pack once, upload to every rank, launch every rank) runs the decode round that
graphs capture (`run_round` from the packed staging arrays), eagerly. Tests compare it with eager rounds."""

from __future__ import annotations

import torch


class StandInRounds:
    """What `Executor._launch_lockstep` needs of `engine.worker.cuda_graphs.GraphedRounds`, without CUDA:
    pinned staging becomes numpy, `upload` copies, and `launch` runs the round eagerly on the rank's
    thread (ranks meet in the local communicator, so each must run on its own thread, as graphs do on
    their own GPU). Rank 0's launch returns a tensor that the last rank's launch fills once every rank
    has finished -- as a device tensor is complete once read, with or without async scheduling."""

    class Bucket:
        def __init__(self, runner, batch):
            from engine.worker.decode_round import pack_round
            self.runner, self.batch = runner, batch
            self.host = pack_round(runner.round_setup, [], batch, runner.max_blocks)

        def pack(self, works):
            from engine.worker.decode_round import pack_round
            pack_round(self.runner.round_setup, works, self.batch, self.runner.max_blocks, out=self.host)

        def upload(self, host=None):
            self.device = tuple(torch.from_numpy(a.copy()) for a in (host or self.host))

    def __init__(self, executor, runner, buckets):
        self.executor, self.runner, self.buckets = executor, runner, buckets
        self.bucket_of = {b: self.Bucket(runner, b) for b in buckets}
        self.launches = 0
        self.out = None                            # rank 0's: the round's output, once every rank ran it

    def fits(self, n):
        return n <= self.buckets[-1]

    def bucket(self, batch):
        return self.bucket_of[batch]

    def select(self, works, variant):
        # a constrained variant masks by the persistent token_masks buffer the executor uploaded, as a
        # captured round does
        return self.bucket_of[next(b for b in self.buckets if b >= len(works))], variant

    def launch(self, bucket, key):
        from engine.worker.decode_round import RoundInputs, RoundOutput, run_round
        r, ex = bucket.runner, self.executor
        rank = ex.runners.index(r)
        inputs = RoundInputs.from_packed(*bucket.device, k=r.k)
        ex._workers[rank].submit(lambda: run_round(r.round_setup, inputs, r.max_seq_len, key))
        self.launches += 1
        if rank == 0:
            self.out = RoundOutput(None, None)       # filled by the last rank's launch, before anyone reads it
        if rank == len(ex.runners) - 1:
            outcomes = [w.outcome() for w in ex._workers]
            bad = [v for ok, v in outcomes if not ok]
            if bad:
                raise bad[0]
            first = ex.runners[0].graphs.out
            first.tokens, first.num_accepted, first.logprobs = (outcomes[0][1].tokens, outcomes[0][1].num_accepted,
                                                                outcomes[0][1].logprobs)
        return self.out if rank == 0 else None
