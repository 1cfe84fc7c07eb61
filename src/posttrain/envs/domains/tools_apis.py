"""`tools.apis`: a simulated shop back office (products, customers, orders) behind 10 typed tools, and
multi-step requests against it, verified the tau-bench way: the final service state must equal the
state produced by replaying the task's gold actions on the same initial state, plus the answer where
one is asked.

The service runs in-process, is rebuilt from the task per episode, and rejects bad arguments with typed
errors (`not_found`, `invalid_argument`, `conflict`, `insufficient_stock`). Levels: 0 = one call with
the tool named and the ids given, plus a reminder of the call syntax (only 4 tools shown, to keep the
prompt short), 1 = lookup then act/answer, 2 = 2-4 dependent calls, 3 = conditional or fan-out requests.

Reward = 0.85 * correct * finished + 0.15 * format. `correct` = 1 when the final state equals the gold
state and (where asked) the `<answer>` equals the gold answer; `finished` = 1 when the model ended the
episode itself (a plain-text reply) and 0.5 when the turn limit cut it off; `format` (see `format_score`)
= 1 when every tool call parsed and passed its schema and at least one was made (every task needs a
call), 0.5 when some but not all did, 0.25 when the model only attempted the markup - a graded signal,
because SmolLM2-135M almost never writes a valid call unprompted. `success` = `correct` (strict:
state and answer right; finishing and format do not enter it). Residual risk: none from code - the model
only emits tool calls to an in-process service; any call sequence that reaches the gold state counts.
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

from posttrain.envs.base import Domain, Environment, clip01
from posttrain.envs.extract import extract_answer, normalize_number
from posttrain.envs.parsers import get_parser
from posttrain.envs.registry import register_env
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import Tool, ToolError, fn_schema
from posttrain.types import Message, Task, ToolSpec

W_CORRECT, W_FORMAT = 0.85, 0.15
ADJECTIVES = ["Red", "Blue", "Green", "Black", "White", "Silver", "Oak", "Steel", "Yellow", "Copper"]
NOUNS = ["Mug", "Lamp", "Chair", "Desk", "Pen", "Notebook", "Bottle", "Backpack", "Clock", "Kettle"]
CATEGORIES = {
    "Mug": "kitchen",
    "Kettle": "kitchen",
    "Bottle": "kitchen",
    "Lamp": "home",
    "Chair": "home",
    "Clock": "home",
    "Desk": "office",
    "Pen": "office",
    "Notebook": "office",
    "Backpack": "office",
}
FIRST = ["Alice", "Bob", "Carol", "David", "Erin", "Frank", "Grace", "Henry", "Ivy", "Jack", "Kate", "Liam"]
LAST = ["Smith", "Jones", "Brown", "Garcia", "Miller", "Davis", "Wilson", "Moore", "Taylor", "Clark"]
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$")

LEVEL0_HINT = 'Reply with only the tool call: <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>'
SYSTEM = (
    "You operate a shop's back office through the tools. Use the exact ids the tools return. "
    "When the request is done, reply in plain text; if a question was asked, put the answer inside "
    "<answer></answer> tags."
)


# ----------------------------------------------------------------------------------------------
# the service


class ShopService:
    """In-process state + the operations behind the tools. Methods raise `ToolError` for bad requests."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state)

    @property
    def products(self) -> dict[str, dict]:
        return self.state["products"]

    @property
    def customers(self) -> dict[str, dict]:
        return self.state["customers"]

    @property
    def orders(self) -> dict[str, dict]:
        return self.state["orders"]

    def _product(self, sku: str) -> dict:
        if sku not in self.products:
            raise ToolError("not_found", f"no product with sku '{sku}'")
        return self.products[sku]

    def _customer(self, customer_id: str) -> dict:
        if customer_id not in self.customers:
            raise ToolError("not_found", f"no customer with id '{customer_id}'")
        return self.customers[customer_id]

    def _order(self, order_id: str) -> dict:
        if order_id not in self.orders:
            raise ToolError("not_found", f"no order with id '{order_id}'")
        return self.orders[order_id]

    # read-only
    def search_products(self, query: str, category: str | None = None) -> list[dict]:
        q = query.strip().lower()
        return [
            dict(p)
            for p in self.products.values()
            if q in p["name"].lower() and (category is None or p["category"] == category)
        ]

    def get_product(self, sku: str) -> dict:
        return dict(self._product(sku))

    def find_customer(self, name: str) -> list[dict]:
        q = name.strip().lower()
        if not q:
            raise ToolError("invalid_argument", "name must not be empty")
        return [dict(c) for c in self.customers.values() if q in c["name"].lower()]

    def list_orders(self, customer_id: str, status: str | None = None) -> list[dict]:
        self._customer(customer_id)
        return [
            copy.deepcopy(o)
            for o in self.orders.values()
            if o["customer_id"] == customer_id and (status is None or o["status"] == status)
        ]

    def compute_total(self, sku: str, quantity: int) -> dict:
        p = self._product(sku)
        return {"sku": sku, "quantity": quantity, "total": p["price"] * quantity}

    # mutating
    def set_price(self, sku: str, price: int) -> dict:
        p = self._product(sku)
        p["price"] = price
        return dict(p)

    def update_stock(self, sku: str, delta: int) -> dict:
        p = self._product(sku)
        if p["stock"] + delta < 0:
            raise ToolError(
                "insufficient_stock", f"stock of '{sku}' is {p['stock']}; cannot apply delta {delta}"
            )
        p["stock"] += delta
        return dict(p)

    def create_customer(self, name: str, email: str) -> dict:
        if not name.strip():
            raise ToolError("invalid_argument", "name must not be empty")
        if not _EMAIL.match(email):
            raise ToolError("invalid_argument", f"'{email}' is not a valid email address")
        if any(c["email"] == email for c in self.customers.values()):
            raise ToolError("conflict", f"a customer with email '{email}' already exists")
        cid = f"C-{self.state['next_customer']}"
        self.state["next_customer"] += 1
        self.customers[cid] = {"id": cid, "name": name.strip(), "email": email}
        return dict(self.customers[cid])

    def create_order(self, customer_id: str, sku: str, quantity: int) -> dict:
        self._customer(customer_id)
        p = self._product(sku)
        if p["stock"] < quantity:
            raise ToolError(
                "insufficient_stock", f"only {p['stock']} units of '{sku}' in stock, {quantity} requested"
            )
        p["stock"] -= quantity
        oid = f"O-{self.state['next_order']}"
        self.state["next_order"] += 1
        self.orders[oid] = {
            "id": oid,
            "customer_id": customer_id,
            "sku": sku,
            "quantity": quantity,
            "total": p["price"] * quantity,
            "status": "open",
        }
        return dict(self.orders[oid])

    def cancel_order(self, order_id: str) -> dict:
        o = self._order(order_id)
        if o["status"] != "open":
            raise ToolError("conflict", f"order '{order_id}' is already {o['status']}")
        o["status"] = "cancelled"
        self.products[o["sku"]]["stock"] += o["quantity"]
        return dict(o)


_STR = {"type": "string", "minLength": 1, "maxLength": 200}
_SKU = {"type": "string", "pattern": "^SKU-[0-9]+$", "description": "product sku, e.g. SKU-104"}
_QTY = {"type": "integer", "minimum": 1, "maximum": 10000}
TOOL_SPECS: dict[str, ToolSpec] = {
    s.name: s
    for s in [
        ToolSpec(
            "search_products",
            "Search products whose name contains the query (case-insensitive).",
            fn_schema(
                {
                    "query": {"type": "string", "maxLength": 200},
                    "category": {"type": "string", "enum": ["kitchen", "home", "office"]},
                },
                ["query"],
            ),
        ),
        ToolSpec("get_product", "Get one product by sku.", fn_schema({"sku": _SKU}, ["sku"])),
        ToolSpec(
            "set_price",
            "Set a product's price (whole dollars).",
            fn_schema(
                {"sku": _SKU, "price": {"type": "integer", "minimum": 1, "maximum": 100000}}, ["sku", "price"]
            ),
        ),
        ToolSpec(
            "update_stock",
            "Add (positive delta) or remove (negative delta) units of stock.",
            fn_schema(
                {"sku": _SKU, "delta": {"type": "integer", "minimum": -10000, "maximum": 10000}},
                ["sku", "delta"],
            ),
        ),
        ToolSpec(
            "find_customer",
            "Find customers whose name contains the given text.",
            fn_schema({"name": _STR}, ["name"]),
        ),
        ToolSpec(
            "create_customer",
            "Create a customer.",
            fn_schema({"name": _STR, "email": _STR}, ["name", "email"]),
        ),
        ToolSpec(
            "list_orders",
            "List a customer's orders, optionally only those with a status.",
            fn_schema(
                {"customer_id": _STR, "status": {"type": "string", "enum": ["open", "cancelled"]}},
                ["customer_id"],
            ),
        ),
        ToolSpec(
            "create_order",
            "Order a quantity of one product for a customer (takes it from stock).",
            fn_schema(
                {"customer_id": _STR, "sku": _SKU, "quantity": _QTY}, ["customer_id", "sku", "quantity"]
            ),
        ),
        ToolSpec(
            "cancel_order",
            "Cancel an open order (returns its units to stock).",
            fn_schema({"order_id": _STR}, ["order_id"]),
        ),
        ToolSpec(
            "compute_total",
            "Price of a quantity of a product.",
            fn_schema({"sku": _SKU, "quantity": _QTY}, ["sku", "quantity"]),
        ),
    ]
}


def make_tools(service: ShopService, names: list[str]) -> dict[str, Tool]:
    return {n: Tool(TOOL_SPECS[n], getattr(service, n)) for n in names}


def replay(initial_state: dict[str, Any], actions: list[list]) -> tuple[dict[str, Any], list[Any]]:
    """Apply gold actions [(tool, args), ...] to a copy of the state; return (final state, results)."""
    service = ShopService(initial_state)
    results = [getattr(service, name)(**args) for name, args in actions]
    return service.state, results


# ----------------------------------------------------------------------------------------------
# task generation


def _initial_state(rng: random.Random) -> dict[str, Any]:
    names = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], rng.randint(6, 9))
    products = {}
    for i, name in enumerate(names):
        sku = f"SKU-{101 + i}"
        products[sku] = {
            "sku": sku,
            "name": name,
            "category": CATEGORIES[name.split()[1]],
            "price": rng.randint(3, 60),
            "stock": rng.randint(0, 30),
        }
    people = rng.sample([(f, last) for f in FIRST for last in LAST], rng.randint(4, 6))
    customers = {}
    for i, (f, last) in enumerate(people):
        cid = f"C-{1 + i}"
        customers[cid] = {
            "id": cid,
            "name": f"{f} {last}",
            "email": f"{f.lower()}.{last.lower()}@example.com",
        }
    orders = {}
    for i in range(rng.randint(2, 5)):
        oid = f"O-{1001 + i}"
        sku = rng.choice(sorted(products))
        qty = rng.randint(1, 3)
        orders[oid] = {
            "id": oid,
            "customer_id": rng.choice(sorted(customers)),
            "sku": sku,
            "quantity": qty,
            "total": products[sku]["price"] * qty,
            "status": rng.choice(["open", "open", "cancelled"]),
        }
    return {
        "products": products,
        "customers": customers,
        "orders": orders,
        "next_order": 1001 + len(orders),
        "next_customer": 1 + len(customers),
    }


def _gen_level0(rng: random.Random, st: dict) -> tuple[str, list, list[str]]:
    kind = rng.choice(["price", "stock", "customer", "cancel"])
    sku = rng.choice(sorted(st["products"]))
    if kind == "price":
        price = rng.randint(5, 99)
        return (
            f"Use set_price to set the price of product {sku} to {price}.",
            [["set_price", {"sku": sku, "price": price}]],
            ["set_price", "update_stock", "get_product", "cancel_order"],
        )
    if kind == "stock":
        n = rng.randint(2, 20)
        return (
            f"Use update_stock to add {n} units to the stock of product {sku}.",
            [["update_stock", {"sku": sku, "delta": n}]],
            ["update_stock", "set_price", "get_product", "create_customer"],
        )
    if kind == "customer":
        taken = {c["name"] for c in st["customers"].values()}
        f, last = rng.choice([(f, la) for f in FIRST for la in LAST if f"{f} {la}" not in taken])
        email = f"{f.lower()}@{last.lower()}.com"
        return (
            f"Use create_customer to create a customer named {f} {last} with email {email}.",
            [["create_customer", {"name": f"{f} {last}", "email": email}]],
            ["create_customer", "find_customer", "set_price", "cancel_order"],
        )
    open_orders = sorted(o for o, v in st["orders"].items() if v["status"] == "open")
    if not open_orders:
        return _gen_level0(rng, st)
    oid = rng.choice(open_orders)
    return (
        f"Use cancel_order to cancel order {oid}.",
        [["cancel_order", {"order_id": oid}]],
        ["cancel_order", "list_orders", "update_stock", "get_product"],
    )


def _units(n: int) -> str:
    return f"{n} unit" if n == 1 else f"{n} units"


def _pick_product(rng: random.Random, st: dict) -> dict:
    return st["products"][rng.choice(sorted(st["products"]))]


def _pick_customer(rng: random.Random, st: dict) -> dict:
    return st["customers"][rng.choice(sorted(st["customers"]))]


def _gen_level1(rng: random.Random, st: dict) -> tuple[str, list, str | None]:
    kind = rng.choice(["price", "stock_q", "email_q", "restock"])
    p = _pick_product(rng, st)
    search = ["search_products", {"query": p["name"]}]
    if kind == "price":
        price = rng.randint(5, 99)
        return (
            f"Set the price of the {p['name']} to {price}.",
            [search, ["set_price", {"sku": p["sku"], "price": price}]],
            None,
        )
    if kind == "stock_q":
        return f"How many units of the {p['name']} are in stock?", [search], str(p["stock"])
    if kind == "email_q":
        c = _pick_customer(rng, st)
        return (
            f"What is the email address of customer {c['name']}?",
            [["find_customer", {"name": c["name"]}]],
            c["email"],
        )
    n = rng.randint(2, 20)
    return (
        f"Add {n} units to the stock of the {p['name']}.",
        [search, ["update_stock", {"sku": p["sku"], "delta": n}]],
        None,
    )


def _gen_level2(rng: random.Random, st: dict) -> tuple[str, list, str | None]:
    kind = rng.choice(["order", "cancel_all", "quote"])
    c = _pick_customer(rng, st)
    if kind == "order":
        in_stock = [p for p in st["products"].values() if p["stock"] >= 1]
        if not in_stock:
            kind = "quote"
        else:
            p = in_stock[rng.randrange(len(in_stock))]
            qty = rng.randint(1, min(p["stock"], 5))
            return (
                f"Customer {c['name']} wants {_units(qty)} of the {p['name']}. Place the order.",
                [
                    ["find_customer", {"name": c["name"]}],
                    ["search_products", {"query": p["name"]}],
                    ["create_order", {"customer_id": c["id"], "sku": p["sku"], "quantity": qty}],
                ],
                None,
            )
    if kind == "cancel_all":
        open_ids = sorted(
            o for o, v in st["orders"].items() if v["customer_id"] == c["id"] and v["status"] == "open"
        )
        if open_ids:
            return (
                f"Cancel every open order of customer {c['name']}.",
                [
                    ["find_customer", {"name": c["name"]}],
                    ["list_orders", {"customer_id": c["id"], "status": "open"}],
                ]
                + [["cancel_order", {"order_id": o}] for o in open_ids],
                None,
            )
    p = _pick_product(rng, st)
    qty = rng.randint(2, 9)
    return (
        f"How much would {_units(qty)} of the {p['name']} cost in total?",
        [["search_products", {"query": p["name"]}], ["compute_total", {"sku": p["sku"], "quantity": qty}]],
        str(p["price"] * qty),
    )


def _gen_level3(rng: random.Random, st: dict) -> tuple[str, list, str | None]:
    if rng.random() < 0.5:
        c = _pick_customer(rng, st)
        p = _pick_product(rng, st)
        qty = p["stock"] + rng.randint(1, 5) if rng.random() < 0.6 else rng.randint(1, max(1, p["stock"]))
        actions: list = [["find_customer", {"name": c["name"]}], ["search_products", {"query": p["name"]}]]
        if p["stock"] < qty:
            actions.append(["update_stock", {"sku": p["sku"], "delta": qty - p["stock"]}])
        actions.append(["create_order", {"customer_id": c["id"], "sku": p["sku"], "quantity": qty}])
        return (
            f"Customer {c['name']} wants {_units(qty)} of the {p['name']}. If there is not enough stock, first add "
            "exactly the missing units to stock. Then place the order and tell me the order id.",
            actions,
            f"O-{st['next_order']}",
        )
    cats = sorted({p["category"] for p in st["products"].values()})
    cat = rng.choice(cats)
    k = rng.randint(1, 5)
    members = [p for p in st["products"].values() if p["category"] == cat]
    return (
        f"Raise the price of every product in category {cat} by {k} dollars.",
        [["search_products", {"query": "", "category": cat}]]
        + [["set_price", {"sku": p["sku"], "price": p["price"] + k}] for p in members],
        None,
    )


def format_score(counts: dict[str, int]) -> float:
    """1 = all calls parsed and valid; 0.5 = some call parsed but some were invalid or unparseable;
    0.25 = tool-call markup attempted but never parseable; 0 = no attempt at a tool call."""
    if counts["tool_calls"] > 0:
        return 1.0 if counts["invalid_tool_calls"] == 0 and counts["unparseable"] == 0 else 0.5
    return 0.25 if counts["unparseable"] > 0 else 0.0


def answers_match(given: str | None, gold: str) -> bool:
    if given is None:
        return False
    g = given.strip().strip("'\"` ").lower()
    return g == gold.lower() or normalize_number(g) == normalize_number(gold.lower())


# ----------------------------------------------------------------------------------------------
# environment and domain


class ShopEnv(ToolEnvironment):
    async def setup(self, task: Task) -> tuple[list[Message], dict[str, Tool]]:
        self.service = ShopService(task.meta["initial_state"])
        self.max_turns = int(task.meta["max_turns"])
        return list(task.prompt), make_tools(self.service, task.meta["tool_names"])

    async def score(self) -> tuple[float, dict[str, float], dict[str, Any]]:
        meta = self.task.meta
        gold_state, _ = replay(meta["initial_state"], meta["gold_actions"])
        state_ok = float(self.service.state == gold_state)
        rewards = {"state": state_ok}
        correct = state_ok
        info: dict[str, Any] = {}
        if meta.get("answer") is not None:
            extracted = extract_answer(self.final_text or "")
            got = extracted.text if extracted.method in ("tags", "boxed", "phrase") else None
            ans_ok = float(answers_match(got, meta["answer"]))
            rewards["answer"] = ans_ok
            correct *= ans_ok
            info["extracted_answer"] = got
        fmt = format_score(self.counts)
        finished = 0.5 if self.truncated else 1.0
        rewards.update(correct=correct, format=fmt, finished=finished, success=correct)
        return clip01(W_CORRECT * correct * finished + W_FORMAT * fmt), rewards, info


@register_env("tools.apis")
class ToolsApisDomain(Domain):
    difficulties = [0, 1, 2, 3]
    description = "simulated shop back office (10 tools); final state vs. replayed gold actions"

    def __init__(self, max_turns: int | None = None) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"tools.apis: max_turns must be >= 1, got {max_turns}")
        self.max_turns_override = max_turns

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            st = _initial_state(rng)
            if difficulty == 0:
                request, actions, tool_names = _gen_level0(rng, st)
                answer = None
            else:
                gen = {1: _gen_level1, 2: _gen_level2, 3: _gen_level3}[difficulty]
                request, actions, answer = gen(rng, st)
                tool_names = list(TOOL_SPECS)
            replay(st, actions)  # the gold actions must run cleanly; raises on a generator bug
            key = f"{request}|{sorted(st['products'].items())}|{sorted(st['customers'].items())}"

            def build() -> Task:
                text = (
                    request if answer is None else request + " Put the answer inside <answer></answer> tags."
                )
                if difficulty == 0:
                    text += " " + LEVEL0_HINT
                max_turns = self.max_turns_override or len(actions) + 2
                meta = {
                    "initial_state": st,
                    "gold_actions": actions,
                    "answer": answer,
                    "tool_names": tool_names,
                    "max_turns": max_turns,
                    "request": request,
                }
                return Task(
                    id="",
                    domain=self.name,
                    difficulty=difficulty,
                    prompt=[Message("system", SYSTEM), Message("user", text)],
                    tools=[TOOL_SPECS[n] for n in tool_names],
                    meta=meta,
                )

            return key, build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task, chat_format: str = "smollm2") -> list[str]:
        fmt = get_parser(chat_format)
        texts = [fmt.format_calls([(name, args)]) for name, args in task.meta["gold_actions"]]
        answer = task.meta.get("answer")
        texts.append("Done." if answer is None else f"<answer>{answer}</answer>")
        return texts

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        env = ShopEnv(chat_format=chat_format, max_turns=self.max_turns_override or 8)
        return env
