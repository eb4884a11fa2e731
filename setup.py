"""Build the C copy kernel (plain CPython extension; only a C compiler is needed)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmkv_async._copy",
            sources=["lmkv_async/_copy.c"],
            extra_compile_args=["-O3", "-std=c11", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
