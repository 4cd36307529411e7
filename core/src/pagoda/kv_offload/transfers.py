"""What the scheduler asks the workers to copy in one step (it travels in ``SchedulerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVTransfers:
    """One step's copies between the device KV cache and the CPU pool, as one job.

    Stores run before loads (a load may fill a block whose old contents a store of the same job
    saves). ``job_id`` is -1 when the step brings no new copy and only carries waits; a job's
    id comes back in ``ModelRunnerOutput.kv_offload_done`` once all of its copies are done.
    """

    job_id: int = -1
    store_gpu: list[int] = field(default_factory=list)  # device block ids, copied out ...
    store_cpu: list[int] = field(default_factory=list)  # ... into these CPU pool slots
    load_cpu: list[int] = field(default_factory=list)  # CPU pool slots, copied in ...
    load_gpu: list[int] = field(default_factory=list)  # ... into these device block ids
    # This step's forward overwrites blocks that this job's stores read: it waits for them.
    stores_first: bool = False
    # Earlier jobs whose copies touch blocks this step reuses: its forward waits for them.
    wait_jobs: list[int] = field(default_factory=list)

    @property
    def has_copies(self) -> bool:
        return bool(self.store_gpu or self.load_cpu)
