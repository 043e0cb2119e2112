"""Engine.from_pretrained on local Hugging Face folders: the path every named model takes after the store."""
from __future__ import annotations

import json

import pytest

from conftest import tiny_model, tiny_tokenizer
from draftwise import DraftwiseError, Engine
from draftwise.backends.hf import load_model, load_tokenizer
from test_errors import RenamedToken

PROMPT = "def quicksort(arr):"


def save(folder, model, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save(root / "target", tiny_model("qwen2", 0), tiny_tokenizer()),
        "draft": save(root / "draft", tiny_model("qwen2", 0, layers=1), tiny_tokenizer()),
    }


def test_a_local_pair_loads_and_keeps_the_targets_greedy_output(folders):
    speculative = Engine.from_pretrained(target=folders["target"], draft=folders["draft"], progress=False)
    alone = Engine.from_pretrained(target=folders["target"], method="none", progress=False)
    assert speculative.method == "draft" and alone.method == "none"
    result = speculative.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == alone.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids
    assert result.stats.proposed > 0


def test_a_tree_method_for_a_draft_with_another_tokenizer_is_refused_before_any_model_loads(folders, tmp_path,
                                                                                           monkeypatch):
    other = save(tmp_path / "other", tiny_model("qwen2", 1), tiny_tokenizer())
    config = tmp_path / "other" / "tokenizer_config.json"  # files other than the target's: its tokenizer is loaded
    config.write_text(json.dumps({**json.loads(config.read_text()), "note": "renamed"}))
    renamed = RenamedToken(tiny_tokenizer(), 270, "ZZ")
    import draftwise.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda path, gguf=None: renamed if path == other else tiny_tokenizer())
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded before the tokenizer check"))
    with pytest.raises(DraftwiseError, match="method 'draft-tree' drafts token trees, which a draft with another "
                                             "tokenizer than the target's does not; it runs draft or hybrid"):
        Engine.from_pretrained(target=folders["target"], draft=other, method="draft-tree", progress=False)


def test_the_smaller_context_of_the_pair_limits_the_prompt():
    draft = tiny_model("llama", 1, 1)
    draft.config.max_position_embeddings = 64
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=draft)
    with pytest.raises(DraftwiseError, match="exceeds the model context of 64 tokens"):
        engine.generate("the fox " * 20, max_new_tokens=40)


def test_a_draft_path_that_does_not_exist_is_refused_before_the_target_is_pulled(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "empty-store"))  # as on a fresh machine: nothing pulled
    pulled = []
    monkeypatch.setattr("draftwise.models.store.pull", lambda name, **_: pulled.append(name))
    with pytest.raises(DraftwiseError, match=r"'\./typo\.gguf' is neither a known model nor a model on disk"):
        Engine.from_pretrained(target="qwen2.5-coder-1.5b-instruct", draft="./typo.gguf", progress=False)
    assert pulled == []  # the known target would have been pulled first (a GB, minutes)


class Pulled(Exception):
    pass


def test_a_pair_of_known_names_not_yet_pulled_is_pulled(tmp_path, monkeypatch):
    # `make demo` on a fresh machine: the pair's check must not take "not pulled" for a name that cannot resolve.
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "empty-store"))
    pulled = []

    def pull(name, **_):
        pulled.append(name)
        raise Pulled  # enough: the store was asked for it

    monkeypatch.setattr("draftwise.models.store.pull", pull)
    with pytest.raises(Pulled):
        Engine.from_pretrained(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                               progress=False)
    assert pulled == ["qwen2.5-coder-1.5b-instruct"]
    assert not (tmp_path / "empty-store").exists()  # the check itself touched nothing


def test_a_damaged_weights_file_is_an_error_that_says_how_to_fetch_it_again(tmp_path):
    folder = save(tmp_path / "damaged", tiny_model("qwen2", 0), tiny_tokenizer())
    weights = next((tmp_path / "damaged").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])  # cut short, as a full disk or a killed copy leaves it
    with pytest.raises(DraftwiseError, match=r"could not load a causal language model from .*damaged.*"
                                             r"`draftwise models pull NAME --force` fetches it again"):
        Engine.from_pretrained(target=folder, method="none", progress=False)


def test_a_folder_that_needs_the_models_own_code_is_refused_not_asked_about(tmp_path, monkeypatch):
    # transformers would ask on the terminal whether to run the folder's code (and wait); a load never runs it.
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my-own-arch", "auto_map": {"AutoConfig": "modeling_mine.MyConfig",
                                                  "AutoModelForCausalLM": "modeling_mine.MyModel"}}))
    (folder / "modeling_mine.py").write_text("raise SystemExit('the model folder code ran')\n")
    with pytest.raises(DraftwiseError, match="could not load a causal language model"):
        load_model(str(folder))
    # On a terminal transformers asks first, unless told no: every load says no.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    asked = []

    def stop_here(*args, **kwargs):
        asked.append(kwargs.get("trust_remote_code"))
        raise OSError("stopped before loading")

    for auto in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", stop_here)
    for load in (load_model, load_tokenizer):
        with pytest.raises(DraftwiseError, match="stopped before loading"):
            load(str(folder))
    assert asked == [False, False]


def test_a_draft_with_the_targets_tokenizer_files_shares_its_tokenizer(folders, tmp_path, monkeypatch):
    from draftwise.loading import same_tokenizer_files
    from draftwise.models import resolve

    target, draft = resolve(folders["target"], progress=False), resolve(folders["draft"], progress=False)
    assert same_tokenizer_files(target, draft)  # the same tiny tokenizer saved twice
    other = save(tmp_path / "other", tiny_model("qwen2", 1), tiny_tokenizer())
    config = tmp_path / "other" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"note": 1, ', 1))
    assert not same_tokenizer_files(target, resolve(other, progress=False))
    import draftwise.loading as loading

    loads = []
    real = loading.load_tokenizer
    monkeypatch.setattr(loading, "load_tokenizer", lambda *a: loads.append(a) or real(*a))
    engine = Engine.from_pretrained(target=folders["target"], draft=folders["draft"], progress=False)
    assert len(loads) == 1 and engine.speed_paths["draft_tokenizer"] == "shared tokenizer"
