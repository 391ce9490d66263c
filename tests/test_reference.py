"""Reference data: packaged files are read-only, the user's go to a user folder, and both are
listed."""

import json

import pytest

from offloadlab import ladder, reference


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    folder = tmp_path / "user-references"
    monkeypatch.setenv(reference.USER_FOLDER_VARIABLE, str(folder))
    return folder


def _packaged_files():
    return {p.name: p.read_bytes() for p in reference.FOLDER.glob("*.json")}


def test_load_save_and_bad_names(tmp_path, user_folder):
    assert "nominal-ladder" in reference.available()
    assert reference.load("nominal-ladder")["kind"] == "nominal"
    with pytest.raises(ValueError, match="^name: expected one of"):
        reference.load("../etc/passwd")
    path = reference.save(
        "test-run", "emulated", "CPU", {"date": "now"}, [{"quantity": "x"}], folder=tmp_path
    )
    assert json.loads(path.read_text())["records"] == [{"quantity": "x"}]
    with pytest.raises(ValueError, match="exists"):
        reference.save("test-run", "emulated", "CPU", {}, [], folder=tmp_path)
    with pytest.raises(ValueError, match="^kind: "):
        reference.save("x", "guessed", "CPU", {}, [], folder=tmp_path)
    with pytest.raises(ValueError, match="^name: expected letters"):
        reference.save("../escape", "emulated", "CPU", {}, [], folder=tmp_path)
    # no temporary files left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test-run.json"]


def test_save_goes_to_the_user_folder_not_the_package(user_folder):
    before = _packaged_files()
    path = reference.save("my-laptop", "emulated", "CPU", {"date": "now"}, [{"quantity": "x"}])
    assert path == user_folder / "my-laptop.json" and path.is_file()
    assert _packaged_files() == before
    assert {"my-laptop", "nominal-ladder"} <= set(reference.available())
    assert (
        reference.origin("my-laptop") == "user" and reference.origin("nominal-ladder") == "packaged"
    )
    assert reference.load("my-laptop")["records"] == [{"quantity": "x"}]


def test_packaged_references_are_never_overwritten(user_folder):
    before = _packaged_files()
    for folder in (None, reference.FOLDER):  # the user folder, and the package named explicitly
        with pytest.raises(ValueError, match="^name: 'nominal-ladder' is"):
            reference.save(
                "nominal-ladder", "measured", "GPU", {}, [], folder=folder, overwrite=True
            )
    assert _packaged_files() == before
    assert ladder.nominal()["tiers"][0]["bandwidth_bytes_per_s"] == 3350e9
    assert not user_folder.exists()  # a refused name creates nothing, not even the folder


def test_target_checks_before_a_measurement(tmp_path, user_folder):
    assert reference.target("fresh") == user_folder / "fresh.json"
    assert not (user_folder / "fresh.json").exists()
    (user_folder / "taken.json").write_text("{}")
    with pytest.raises(ValueError, match="exists"):
        reference.target("taken")
    assert reference.target("taken", overwrite=True) == user_folder / "taken.json"
    with pytest.raises(ValueError, match="^name: expected letters"):
        reference.target("")


def test_a_damaged_user_file_is_named(user_folder):
    user_folder.mkdir()
    (user_folder / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not an offloadlab-reference/1 file"):
        reference.load("broken")
