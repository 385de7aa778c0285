"""Models by their Hugging Face Hub id: `--model-path ORG/NAME` (or `ORG/NAME/FILE.gguf`) becomes
the local snapshot folder (or file) in the Hugging Face cache, downloaded through
`huggingface_hub` unless cached, with only the files pyserve reads.

`huggingface_hub` reads its own settings from the environment: HF_HOME / HF_HUB_CACHE (where
the cache is), HF_TOKEN (private and gated models), HF_HUB_OFFLINE (the cache only),
HF_ENDPOINT (a mirror). It is imported only for a path that is not on this machine, so a local
model starts without it, and it never imports torch: a bad Hub id is refused before torch
loads."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from pyserve.model_loader.default_model import ModelNotFoundError

if TYPE_CHECKING:
    from pyserve.config import ServerArgs

logger = logging.getLogger(__name__)

# What pyserve reads from a checkpoint folder besides its weights: the config
# (model_loader/config.py), the tokenizer and its chat templates (transformers' AutoTokenizer:
# fast, sentencepiece, BPE and WordPiece vocabularies), and a sentence-transformers model's
# pooling and length (layers/pooler.py reads each module's config.json, named in modules.json)
CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
# the weights, in hf_loader.safetensors_files' order: the shards an index names, else
# model.safetensors, else every top-level *.safetensors (a subfolder's are other formats'
# copies, e.g. onnx/)
SINGLE_WEIGHTS = "model.safetensors"
ANY_WEIGHTS = "*.safetensors"
SUBFOLDER_WEIGHTS = "*/*.safetensors"

# ServerArgs fields that name a model or tokenizer, with their flags, resolved by
# `resolve_hub_paths`; weights: whether the weights are fetched too (a tokenizer needs none).
# A draft model's path joins with weights; a LoRA adapter's would need its own file list.
HUB_PATH_FIELDS = (("model_path", "--model-path", True), ("tokenizer_path", "--tokenizer-path", False))


def hub_id(path: str) -> tuple[str, str | None] | None:
    """(repo id, file in the repo or None) when `path` names a Hub model, else None.

    A Hub id is a path that does not exist on this machine and reads as `ORG/NAME`
    (huggingface_hub's `validate_repo_id`), or `ORG/NAME/FILE.gguf` (one GGUF file of the
    repo; FILE may hold folders). Never Hub ids, so a mistyped local path fails as one and
    sends no name of this machine's folders to the Hub: `./x`, `/abs/x`, `~/x`, a bare `NAME`
    (a file or folder in the current one, more likely than a legacy Hub id), a path whose
    first folder exists here, and `ORG/NAME` ending in .gguf, .safetensors or .json.
    Any thread; a few stat calls (plus huggingface_hub's import when the path is missing)."""
    if os.path.exists(path):
        return None
    parts = path.split("/")
    if len(parts) < 2 or os.path.isdir(parts[0]):
        return None
    if len(parts) == 2 and path.lower().endswith((".gguf", ".safetensors", ".json")):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, filename = path, None
    if len(parts) > 2 and path.lower().endswith(".gguf"):
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, filename


def resolve_model_path(path: str, revision: str | None, flag: str = "--model-path", *, weights: bool = True) -> str:
    """The local path to load for `path`: `path` itself unless it is a Hub id (`hub_id`),
    else its snapshot folder (or GGUF file) in the Hugging Face cache, downloaded first
    unless cached.

    revision: a branch, tag or commit of the Hub repo (None: main); unused for local paths.
    flag: the flag named in error messages (`--model-path`, `--tokenizer-path`).
    weights: fetch the safetensors weights too (False: config and tokenizer files only).
    A repo is fetched in two steps: the config, tokenizer and sentence-transformers files
    (and model.safetensors), then the weights an index names and the pooling modules' configs.
    Raises ModelNotFoundError (a ValueError) with a one-line message naming `flag`: not in
    the cache while HF_HUB_OFFLINE is set or the Hub cannot be reached; no such repo (or
    private without HF_TOKEN); gated; no such revision or file; a repo without config.json
    (naming its GGUF files, to pass one instead); a failed download. Blocks while it
    downloads (progress bars on stderr); any thread."""
    parsed = hub_id(path)
    if parsed is None:
        return path
    repo_id, filename = parsed
    from huggingface_hub import constants

    where = f"{flag} {path}" + (f" --revision {revision}" if revision else "")
    if constants.HF_HUB_OFFLINE:  # nothing to download: a refusal stays the one line on stderr
        logger.debug("looking up %s (%s) in %s", repo_id, revision or "main", constants.HF_HUB_CACHE)
    else:
        logger.info("downloading %s (%s) to %s", repo_id, revision or "main", constants.HF_HUB_CACHE)
    try:
        if filename is not None:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo_id, filename, revision=revision)
        return _snapshot(repo_id, revision, where, flag, weights)
    except ModelNotFoundError:
        raise
    except Exception as exc:  # what huggingface_hub raises varies with its version and HTTP library
        logger.debug("resolving %s failed", path, exc_info=True)
        raise ModelNotFoundError(f"{where}: {_hub_failure(exc, repo_id, filename, revision)}") from None


def resolve_hub_paths(server_args: ServerArgs) -> ServerArgs:
    """`server_args` with each Hub id in HUB_PATH_FIELDS replaced by its local path
    (`resolve_model_path` with `server_args.revision`); the same object when none is a Hub
    id. A Hub model is served under its id (`served_model_name`, unless given), as SGLang
    names a model by its --model-path, not by the snapshot folder's commit hash.
    Raises ModelNotFoundError as resolve_model_path does; blocks while it downloads."""
    changes: dict[str, Any] = {}
    for field, flag, weights in HUB_PATH_FIELDS:
        path = getattr(server_args, field)
        if path is None:
            continue
        local = resolve_model_path(path, server_args.revision, flag, weights=weights)
        if local != path:
            changes[field] = local
    if not changes:
        if server_args.revision is not None:  # a revision picks nothing on a local path
            logger.warning("--revision %s: unused (no model or tokenizer path is a Hub id)", server_args.revision)
        return server_args
    if "model_path" in changes and server_args.served_model_name is None:
        changes["served_model_name"] = [server_args.model_path]
    return dataclasses.replace(server_args, **changes)


def _snapshot(repo_id: str, revision: str | None, where: str, flag: str, weights: bool) -> str:
    from huggingface_hub import snapshot_download

    first = [*CONFIG_FILES, *TOKENIZER_FILES, *SENTENCE_TRANSFORMERS_FILES]
    if weights:
        first.append(SINGLE_WEIGHTS)
    folder = snapshot_download(repo_id, revision=revision, allow_patterns=first)
    if not weights:
        return folder
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(f"{where}: {_without_config(repo_id, folder, flag)}")
    more, ignore = remaining_files(folder)
    if not more:
        return folder
    # the snapshot folder is named by its commit: the second step fetches the same commit
    # even if the branch moved meanwhile
    return snapshot_download(repo_id, revision=os.path.basename(folder), allow_patterns=more, ignore_patterns=ignore)


def remaining_files(folder: str) -> tuple[list[str], list[str] | None]:
    """The second step's (allow, ignore) patterns, read from the first step's files in
    `folder`: the shards model.safetensors.index.json names, else every top-level
    *.safetensors when there is no model.safetensors, and the config.json of each module
    modules.json names. ([], None): nothing more to fetch. Raises OSError for an unreadable
    file, ValueError for one that is not JSON, KeyError for an index without weight_map."""
    more: list[str] = []
    ignore = None
    index = os.path.join(folder, CONFIG_FILES[2])
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            more += sorted(set(json.load(f)["weight_map"].values()))
    elif not os.path.isfile(os.path.join(folder, SINGLE_WEIGHTS)):
        more.append(ANY_WEIGHTS)
        ignore = [SUBFOLDER_WEIGHTS]
    modules = os.path.join(folder, "modules.json")
    if os.path.isfile(modules):
        with open(modules, encoding="utf-8") as f:
            paths = [m.get("path", "") for m in json.load(f)]
        more += [f"{p}/config.json" for p in paths if p]
    return more, ignore


def _without_config(repo_id: str, folder: str, flag: str) -> str:
    ggufs = sorted(n for n in _repo_files(repo_id, folder) if n.lower().endswith(".gguf"))
    if ggufs:
        return f"the repository has no config.json; to serve one of its GGUF files, pass {flag} {repo_id}/{ggufs[0]}"
    return "the repository has no config.json (pyserve serves a folder with config.json and *.safetensors, or a .gguf)"


def _repo_files(repo_id: str, folder: str) -> list[str]:
    """The repo's file names: from the Hub when it answers, else those cached in `folder`."""
    from huggingface_hub import HfApi

    try:
        return HfApi().list_repo_files(repo_id, revision=os.path.basename(folder))
    except Exception:  # offline or unreachable: the listing only names a file in the message
        return os.listdir(folder) if os.path.isdir(folder) else []


def _hub_failure(exc: Exception, repo_id: str, filename: str | None, revision: str | None) -> str:
    """One line saying why huggingface_hub could not provide the model."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = constants.HF_HUB_CACHE
    if isinstance(exc, LocalEntryNotFoundError):
        if constants.HF_HUB_OFFLINE:
            return (
                f"not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                "download it once with network access or pass a local folder"
            )
        cause = exc.__cause__ or exc
        return (
            f"not in the Hugging Face cache ({cache}) and the Hub cannot be reached ({type(cause).__name__}); "
            "check the network (HF_ENDPOINT for a mirror) or pass a local folder"
        )
    if isinstance(exc, GatedRepoError):
        return (
            f"a gated model: accept its terms on https://huggingface.co/{repo_id} and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return f"no such local path, and no model {repo_id} on the Hugging Face Hub (a private one needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"the Hub repository {repo_id} has no revision {revision}"
    if isinstance(exc, EntryNotFoundError):
        return f"the Hub repository {repo_id} has no file {filename}"
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status == 401:
            return "the Hugging Face Hub refused the token (401): check HF_TOKEN"
        return f"the Hugging Face Hub answered {status} for {repo_id}"
    if isinstance(exc, OSError):
        return f"download failed ({exc.strerror or _first_line(exc)})"
    return f"download failed ({type(exc).__name__}: {_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
