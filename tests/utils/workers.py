"""Worker classes for tests, named by `worker_cls` (imported by qualified name in each
worker process)."""

from __future__ import annotations

from decodegraph.graphs.dispatcher import CudagraphDispatcher
from decodegraph.graphs.graph_runner import CaptureStats
from decodegraph.worker.worker import Worker


class DivergingWorker(Worker):
    """Rank 1 forgets its largest capture size after capturing: where the driver plans
    a replay of that size, this rank's own dispatch says eager."""

    def capture_graphs(self) -> CaptureStats:
        stats = super().capture_graphs()
        if self.rank == 1:
            gr = self.runner.graph_runner
            sizes = gr.capture_sizes[:-1]
            gr.dispatcher = CudagraphDispatcher(gr.mode, sizes, gr.max_num_reqs)
        return stats
