"""The committed generated code matches the .proto sources under the pinned grpcio-tools."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto_sources():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_drift_is_detected(tmp_path, monkeypatch):
    """The check is not vacuous: an edited generated file makes it fail."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    target = tmp_path / "stalwart" / "v1"
    target.mkdir(parents=True)
    for src in (ROOT / "protos" / "stalwart" / "v1").iterdir():
        target.joinpath(src.name).write_bytes(src.read_bytes())
    victim = target / "common_pb2.py"
    victim.write_text(victim.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(gen_protos, "PKG", target)
    monkeypatch.setattr(gen_protos, "PROTO_ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gen_protos.py", "--check"])
    assert gen_protos.main() == 1


def test_tensor_metadata_round_trips_without_pickle():
    from stalwart.v1 import common_pb2

    meta = common_pb2.TensorMeta(name="layers.3.mlp.w1", dtype=common_pb2.FLOAT32,
                                 shape=[64, 256], global_shape=[64, 512], offsets=[0, 256],
                                 layer=3, nbytes=64 * 256 * 4)
    again = common_pb2.TensorMeta.FromString(meta.SerializeToString())
    assert again == meta
    assert list(again.offsets) == [0, 256]
