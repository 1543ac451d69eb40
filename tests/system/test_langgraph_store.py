"""LangGraph's store over the memory API (``InferScaleStore``), held to the behaviour of
LangGraph's own ``InMemoryStore``: the same tests run against both (pinned ``langgraph``),
ours against the suite's live server; where the two differ by design (the module's docstring
lists it), a test says so. Then a small LangGraph graph remembers across threads, and what it
stored is memory the server serves."""

import asyncio
import uuid

import pytest
from langgraph.store.memory import InMemoryStore

from conftest import SUITE_KEY
from inferscale_client.langgraph_store import InferScaleStore

pytestmark = pytest.mark.slow


@pytest.fixture(params=["langgraph", "inferscale"])
def store(request, embedder):
    if request.param == "langgraph":
        return InMemoryStore(index={"dims": 384, "embed": lambda texts: embedder.encode(
            list(texts)).tolist(), "fields": ["text"]})
    served = request.getfixturevalue("served")
    return InferScaleStore(served.url, api_key=SUITE_KEY, index={"fields": ["text"]})


def owner() -> str:
    return f"lg-{uuid.uuid4().hex[:8]}"


def test_put_get_update_and_delete(store):
    ns = (owner(), "memories")
    assert store.get(ns, "horse") is None
    store.put(ns, "horse", {"text": "Ines's horse is Biscuit.", "kind": "pet"})
    first = store.get(ns, "horse")
    assert first is not None and first.value == {"text": "Ines's horse is Biscuit.",
                                                  "kind": "pet"}
    assert (first.namespace, first.key) == (ns, "horse")
    store.put(ns, "horse", {"text": "Ines's horse is Pickles now.", "kind": "pet"})
    second = store.get(ns, "horse")
    assert second.value["text"] == "Ines's horse is Pickles now."
    assert second.updated_at >= first.updated_at
    assert store.get((ns[0], "elsewhere"), "horse") is None  # namespaces are apart
    store.delete(ns, "horse")
    assert store.get(ns, "horse") is None


def test_search_ranks_by_the_query_within_a_prefix_and_filters_on_value_fields(store):
    user = owner()
    facts = {"horse": ("Ines's horse is called Biscuit.", "pet", 3),
             "job": ("Ines teaches chemistry in Porto.", "work", 1),
             "food": ("Ines is vegetarian.", "diet", 2)}
    for key, (text, kind, rank) in facts.items():
        store.put((user, "memories"), key, {"text": text, "kind": kind, "rank": rank})
    store.put((user, "other"), "horse", {"text": "A horse elsewhere.", "kind": "pet"})
    found = store.search((user, "memories"), query="What is the name of her horse?", limit=3)
    assert [item.key for item in found][:1] == ["horse"]
    assert all(item.namespace == (user, "memories") for item in found)
    assert all(isinstance(item.score, float) for item in found)
    assert {i.namespace for i in store.search((user,), limit=10)} == {(user, "memories"),
                                                                     (user, "other")}
    pets = store.search((user,), filter={"kind": "pet"}, limit=10)
    assert sorted(i.namespace for i in pets) == [(user, "memories"), (user, "other")]
    ranked = store.search((user, "memories"), filter={"rank": {"$gte": 2}}, limit=10)
    assert sorted(i.key for i in ranked) == ["food", "horse"]
    page = store.search((user, "memories"), limit=2)
    rest = store.search((user, "memories"), limit=2, offset=2)
    assert len(page) == 2 and len(rest) == 1
    assert {i.key for i in page + rest} == set(facts)


def test_list_namespaces_under_an_owner(store):
    user = owner()
    for ns in ((user, "memories"), (user, "projects", "a"), (user, "projects", "b")):
        store.put(ns, "k", {"text": f"something about {ns[-1]}"})
    assert store.list_namespaces(prefix=(user,)) == [
        (user, "memories"), (user, "projects", "a"), (user, "projects", "b")]
    assert store.list_namespaces(prefix=(user,), max_depth=2) == [(user, "memories"),
                                                                  (user, "projects")]
    assert store.list_namespaces(prefix=(user, "projects"), suffix=("b",)) == [
        (user, "projects", "b")]


def test_the_async_api_is_the_same(store):
    ns = (owner(), "memories")

    async def go():
        await store.aput(ns, "job", {"text": "Ines teaches chemistry."})
        got = await store.aget(ns, "job")
        found = await store.asearch(ns, query="Where does Ines work?")
        await store.adelete(ns, "job")
        return got, found, await store.aget(ns, "job")

    got, found, gone = asyncio.run(go())
    assert got.value == {"text": "Ines teaches chemistry."}
    assert [i.key for i in found] == ["job"] and gone is None


def test_where_inferscale_differs_by_design(served):
    store = InferScaleStore(served.url, api_key=SUITE_KEY)
    with pytest.raises(ValueError, match="owner"):
        store.search((), query="anything")  # InMemoryStore searches every namespace
    with pytest.raises(ValueError, match="prefix naming one owner"):
        store.list_namespaces()
    with pytest.raises(NotImplementedError):
        store.put((owner(), "m"), "k", {"text": "x"}, ttl=5)
    with pytest.raises(ValueError, match="not supported"):
        store.search((owner(),), filter={"kind": {"$in": ["a"]}})
    wrong = InferScaleStore(served.url, api_key="not-a-key")
    with pytest.raises(Exception, match="401"):
        wrong.get((owner(), "m"), "k")


async def test_a_langgraph_agent_remembers_across_threads_and_the_server_serves_it(served):
    """A graph whose node stores what the user says and reads the store before answering: a
    second thread finds what the first stored, and a memory chat of the owner is served it."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.store.base import BaseStore

    from conftest import AUTH

    store = InferScaleStore(served.url, api_key=SUITE_KEY)
    user = owner()

    async def remember_and_recall(state: MessagesState, config, *, store: BaseStore):
        said = state["messages"][-1].content
        ns = (config["configurable"]["user_id"], "memories")
        if said.startswith("Remember:"):
            await store.aput(ns, str(uuid.uuid4()), {"text": said.removeprefix("Remember:")})
        recalled = await store.asearch(ns, query=said, limit=1)
        return {"messages": [{"role": "assistant", "content": " ".join(
            i.value["text"] for i in recalled) or "nothing yet"}]}

    builder = StateGraph(MessagesState)
    builder.add_node("remember_and_recall", remember_and_recall)
    builder.add_edge(START, "remember_and_recall")
    graph = builder.compile(store=store)
    await graph.ainvoke({"messages": [{"role": "user",
                                       "content": "Remember: My horse is called Biscuit."}]},
                        {"configurable": {"thread_id": "1", "user_id": user}})
    later = await graph.ainvoke({"messages": [{"role": "user",
                                               "content": "What is my horse called?"}]},
                                {"configurable": {"thread_id": "2", "user_id": user}})
    assert "Biscuit" in later["messages"][-1].content
    import httpx

    chat = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "inferscale", "user": user, "max_tokens": 4, "inferscale": {"k": 2},
        "messages": [{"role": "user", "content": "What is my horse called?"}]})
    assert chat.status_code == 200 and chat.headers["x-inferscale-facts"] == "1"
