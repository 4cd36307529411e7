"""Which decoder layers each pipeline stage holds (``parallel.pipeline_parallel_size``).

Pure arithmetic on the config's numbers: the engine checks a partition before any worker
starts, and each worker takes its stage's range from the same call.
"""

from __future__ import annotations


def split_layers(
    num_layers: int, pipeline_size: int, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """Each stage's layers as ``[start, end)``, first stage first: ``partition`` (layers per
    stage) when given, else an even split. Raises ValueError, one line naming the keys, for a
    split that cannot be made."""
    if pipeline_size < 1:
        raise ValueError(f"parallel.pipeline_parallel_size={pipeline_size} must be at least 1")
    if partition is not None:
        if len(partition) != pipeline_size:
            raise ValueError(
                f"parallel.pipeline_layer_partition={partition} names {len(partition)} stages; "
                f"parallel.pipeline_parallel_size={pipeline_size} needs one count per stage"
            )
        if any(n < 1 for n in partition):
            raise ValueError(
                f"parallel.pipeline_layer_partition={partition}: every stage needs at least "
                "one layer"
            )
        if sum(partition) != num_layers:
            raise ValueError(
                f"parallel.pipeline_layer_partition={partition} sums to {sum(partition)}; "
                f"the model has {num_layers} layers"
            )
        counts = list(partition)
    else:
        if pipeline_size > num_layers:
            raise ValueError(
                f"parallel.pipeline_parallel_size={pipeline_size} is larger than the model's "
                f"{num_layers} layers; each stage needs at least one"
            )
        if num_layers % pipeline_size:
            per = num_layers // pipeline_size
            extra = num_layers % pipeline_size
            hint = [per + (i < extra) for i in range(pipeline_size)]
            raise ValueError(
                f"parallel.pipeline_parallel_size={pipeline_size} does not split the model's "
                f"{num_layers} layers evenly; give parallel.pipeline_layer_partition (layers "
                f"per stage, e.g. {hint})"
            )
        counts = [num_layers // pipeline_size] * pipeline_size
    ranges, start = [], 0
    for n in counts:
        ranges.append((start, start + n))
        start += n
    return ranges
