"""langchain-openai's `OpenAIEmbeddings` against a pyserve embedding server, run by
tests/e2e/test_embeddings_server.py in the client venv.

Usage: python embedding_clients.py BASE_URL MODEL TEXT [TEXT ...]. Prints one JSON line:
{"documents": embed_documents(texts), "query": embed_query(first text)}.
`check_embedding_ctx_length=False`: langchain otherwise tokenizes with OpenAI's tiktoken
and sends those ids, which mean nothing to another model's vocabulary.
"""

import json
import sys

from langchain_openai import OpenAIEmbeddings

base_url, model, texts = sys.argv[1], sys.argv[2], sys.argv[3:]
embeddings = OpenAIEmbeddings(
    model=model, base_url=base_url + "/v1", api_key="unused", check_embedding_ctx_length=False
)
print(json.dumps({"documents": embeddings.embed_documents(texts), "query": embeddings.embed_query(texts[0])}))
