"""The one C extension, built against CPython's limited API: one abi3 wheel serves CPython 3.10+."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchhal_speedups._guards",
            ["torchhal_speedups/_guards.c"],
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
