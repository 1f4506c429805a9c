"""Generates the sandbox service's gRPC stubs from sandbox/proto/sandbox.proto when the package is built or installed.

Everything else about the package is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO = Path("sandbox/proto/sandbox.proto")


def generate_stubs() -> None:
    """Run protoc (from grpcio-tools) into the source tree, so both wheels and editable installs get the stubs."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{include}", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
