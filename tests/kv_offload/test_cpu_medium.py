"""The core's medium on its own: layers that are slices of one tensor are copied as one view
(one kernel a chunk on a GPU), and it moves the same bytes as copying layer by layer."""

from __future__ import annotations

import torch

from pagoda.kv_offload import KVTransfers
from pagoda.kv_offload.cpu import CPUMedium, _runs, stack_layers

LAYERS, BLOCKS = 3, 10
SHAPE = (2, BLOCKS, 4, 2, 8)  # the default cache shape: blocks at dim 1


def _stacked_caches() -> list[torch.Tensor]:
    return list(torch.zeros((LAYERS, *SHAPE)).unbind(0))


def _separate_caches() -> list[torch.Tensor]:
    return [torch.zeros(SHAPE) for _ in range(LAYERS)]


def _fill(caches: list[torch.Tensor]) -> None:
    for i, kv in enumerate(caches):
        kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).view(kv.shape) + 1000 * i)


def test_slices_of_one_tensor_stack_into_one_view_over_the_same_memory() -> None:
    caches = _stacked_caches()
    view = stack_layers([kv.movedim(1, 0) for kv in caches])
    assert view is not None and view.shape == (BLOCKS, LAYERS, 2, 4, 2, 8)
    view[7, 2] = 5.0
    assert (caches[2][:, 7] == 5.0).all() and caches[2].sum() == 5.0 * 2 * 4 * 2 * 8
    assert caches[1].sum() == 0 and caches[0].sum() == 0


def test_separate_tensors_and_uneven_slices_do_not_stack() -> None:
    assert stack_layers([kv.movedim(1, 0) for kv in _separate_caches()]) is None
    slices = list(torch.zeros((2 * LAYERS, *SHAPE)).unbind(0))
    uneven = [slices[0], slices[1], slices[3]]
    assert stack_layers([kv.movedim(1, 0) for kv in uneven]) is None


def test_runs_split_where_either_side_breaks() -> None:
    assert list(_runs([4, 5, 6, 9, 10], range(5))) == [(4, 0, 3), (9, 3, 2)]
    assert list(_runs([1, 2, 3], [7, 9, 10])) == [(1, 7, 1), (2, 9, 2)]


def test_stacked_and_layer_by_layer_copies_move_the_same_blocks() -> None:
    mediums = []
    for caches in (_stacked_caches(), _separate_caches()):
        _fill(caches)
        medium = CPUMedium(caches, block_dim=1, num_blocks=6)
        medium.submit(KVTransfers(job_id=0, store_gpu=[3, 4, 8, 1], store_cpu=[0, 1, 2, 5]))
        for kv in caches:
            kv.zero_()
        medium.submit(KVTransfers(job_id=1, load_cpu=[5, 0, 1], load_gpu=[9, 2, 3]))
        assert medium.poll() == [0, 1] and medium.num_in_flight == 0
        mediums.append((medium, caches))
    (stacked, a), (apart, b) = mediums
    assert stacked.stacked is not None and apart.stacked is None
    written = [0, 1, 2, 5]
    assert torch.equal(stacked.cpu[written], apart.cpu[written])
    for ca, cb in zip(a, b):
        assert torch.equal(ca, cb)
    ref = _separate_caches()
    _fill(ref)
    for layer in range(LAYERS):
        for dst, src in ((9, 1), (2, 3), (3, 4)):
            assert torch.equal(a[layer][:, dst], ref[layer][:, src])
        assert a[layer][:, [0, 1, 4, 5, 6, 7, 8]].abs().sum() == 0
