"""The "Reading the package" page names only modules and functions that exist, and places every
module of the package in a layer: it is computed from the installed package, and these tests fail
as soon as a module or function it names is gone (renamed, moved, split) or a new module has no
layer yet."""

import jupytext
import pytest

from tests.conftest import ROOT

PAGE = ROOT / "book" / "reading_the_package.md"


def page_namespace() -> dict:
    """The namespace the page's code cells build: LAYERS, READ_FIRST and their helpers. Running
    them also runs the page's own checks (its hidden cells)."""
    namespace = {}
    for cell in jupytext.read(PAGE).cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, str(PAGE), "exec"), namespace)
    return namespace


PAGE_NAMESPACE = page_namespace()


@pytest.fixture
def page():
    return PAGE_NAMESPACE


def test_every_module_it_names_exists(page):
    named = {f"offloadlab.{m}" for members in page["LAYERS"].values() for m in members}
    assert named and named <= set(page["modules"]()), sorted(named - set(page["modules"]()))


def test_every_module_of_the_package_is_in_a_layer_and_says_its_job(page):
    for name, path in page["modules"]().items():
        assert page["layer_of"](name), f"{name} is in no layer of the page"
        assert page["job"](path), f"{name} has no docstring saying what it is for"


@pytest.mark.parametrize("target", [target for _, _, target in PAGE_NAMESPACE["READ_FIRST"]])
def test_every_function_it_names_exists(page, target):
    assert callable(page["resolve"](target)), target


def test_it_names_a_function_for_every_chapter(page):
    assert {chapter for chapter, _, _ in page["READ_FIRST"]} >= {str(n) for n in range(1, 10)}


def test_the_checks_fail_for_what_does_not_exist(page):
    with pytest.raises(ModuleNotFoundError):
        page["resolve"]("offloadlab.no_such_module:anything")
    with pytest.raises(AttributeError):
        page["resolve"]("offloadlab.link:NoSuchLink.copy")
    assert page["layer_of"]("offloadlab.a_new_module") is None


def test_the_page_is_in_the_book_after_the_chapters_and_before_the_labs():
    index = (ROOT / "book" / "index.md").read_text(encoding="utf-8")
    assert (
        index.index("09_wrong_tool")
        < index.index("reading_the_package")
        < index.index("labs/lab01")
    )
