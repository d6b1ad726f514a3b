"""The one line a benchmark keeps of a failed child process: the exception's, not the C++ stack after it."""

from ndparallel.testing.child_errors import failure_line

CUDA_FAILURE = """Traceback (most recent call last):
  File "bench.py", line 9, in <module>
torch.AcceleratorError: CUDA error: an illegal memory access was encountered
Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:44 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d
"""


def test_the_exception_line_not_the_last_frame():
    assert failure_line(CUDA_FAILURE) == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


def test_without_an_exception_line_the_last_error_or_line():
    assert failure_line("starting\nerror: no such file\nbye\n") == "error: no such file"
    assert failure_line("just this\n") == "just this"
    assert failure_line("") == "(no output)"
    assert failure_line("RuntimeError: " + "x" * 500, limit=20) == "RuntimeError: xxxxxx"
