from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from feedline.io import BufferPool, load_npy, to_jax, to_numpy, to_torch, transfer  # noqa: E402


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_to_torch_shares_memory_with_a_writable_array() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = to_torch(array)
    tensor[0, 0] = 99
    assert array[0, 0] == 99
    assert tensor.data_ptr() == array.ctypes.data


def test_to_torch_from_load_npy_on_a_bytearray_is_zero_copy() -> None:
    data = bytearray(npy(np.arange(100, dtype=np.int64)))
    array = load_npy(data)
    tensor = to_torch(array)
    assert tensor.data_ptr() == array.ctypes.data
    tensor[5] = -1
    assert load_npy(data)[5] == -1  # the very bytes were written


def test_read_only_arrays_are_copied_or_refused() -> None:
    array = load_npy(npy(np.arange(10)))  # a view of immutable bytes
    assert not array.flags.writeable
    tensor = to_torch(array)
    assert tensor.data_ptr() != array.ctypes.data
    assert tensor.tolist() == list(range(10))
    with pytest.raises(ValueError, match="read-only"):
        to_torch(array, copy=False)


def test_copy_true_always_copies() -> None:
    array = np.ones(4)
    assert to_torch(array, copy=True).data_ptr() != array.ctypes.data
    tensor = torch.ones(3)
    assert to_torch(tensor) is tensor
    assert to_torch(tensor, copy=True).data_ptr() != tensor.data_ptr()


def test_big_endian_arrays_become_native() -> None:
    array = np.arange(5, dtype=">i4")
    assert to_torch(array).tolist() == [0, 1, 2, 3, 4]
    assert to_torch(array, copy=True).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="byte order"):
        to_torch(array, copy=False)


def test_reversed_views_are_copied_in_order_or_refused() -> None:
    array = np.arange(12).reshape(3, 4)
    for view in (array[::-1], array[:, ::-2], array[::-1].T):
        for copy in (None, True):
            assert to_torch(view, copy=copy).tolist() == view.tolist()
        with pytest.raises(ValueError, match="negative strides"):
            to_torch(view, copy=False)
    assert to_torch(array.T).data_ptr() == array.ctypes.data  # positive strides: shared


def test_to_numpy_shares_memory_with_a_cpu_tensor() -> None:
    tensor = torch.arange(6)
    array = to_numpy(tensor)
    array[0] = 42
    assert int(tensor[0]) == 42
    assert to_numpy(array) is array


def test_to_numpy_through_dlpack() -> None:
    class OnlyDlpack:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self.tensor.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> Any:
            return self.tensor.__dlpack_device__()

    tensor = torch.arange(4, dtype=torch.float64)
    array = to_numpy(OnlyDlpack(tensor))
    assert array.ctypes.data == tensor.data_ptr()


def test_to_numpy_refuses_a_tensor_off_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"\.cpu\(\) first"):
        to_numpy(torch.empty(3, device="meta"))


def test_transfer_without_cuda_says_so() -> None:
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        transfer({"image": np.zeros((2, 3)), "label": 1})


def test_to_jax_converts_or_says_how_to_install() -> None:
    array = np.arange(6, dtype=np.float32)
    try:
        import jax  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install jax"):
            to_jax(array)
        return
    assert np.asarray(to_jax(array)).tolist() == array.tolist()


def test_to_jax_shares_aligned_memory_and_copies_read_only_arrays() -> None:
    jax = pytest.importorskip("jax")
    pool = BufferPool((4, 8), np.float32, count=1)
    batch = pool.acquire()
    batch[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    shared = to_jax(batch)
    assert isinstance(shared, jax.Array)
    assert shared.unsafe_buffer_pointer() == batch.ctypes.data  # the batch's own memory
    frozen = load_npy(npy(np.arange(5, dtype=np.int64)))
    assert not frozen.flags.writeable
    assert np.asarray(to_jax(frozen)).tolist() == [0, 1, 2, 3, 4]  # copied, not refused
    tensor = torch.arange(6, dtype=torch.float32)
    assert np.asarray(to_jax(tensor)).tolist() == tensor.tolist()


def test_a_bfloat16_tensor_says_how_to_convert_it() -> None:
    with pytest.raises(TypeError, match=r"bfloat16.*tensor\.float\(\)"):
        to_numpy(torch.ones(2, dtype=torch.bfloat16))
