"""JSON schemas as clients send them, recorded (pydantic is not in the lock): what pydantic 2's
`Model.model_json_schema()` gives for the models in each comment, the openai SDK's strict form of
one (`client.chat.completions.parse(response_format=Model)` sends `to_strict_json_schema(Model)`),
and LangChain's tool schema of a function. Keys are in the order pydantic writes them.
"""

from __future__ import annotations

from typing import Any

# class Color(str, Enum): red = "red"; green = "green"; blue = "blue"
# class Address(BaseModel):
#     street: str
#     zip: str = Field(min_length=5, max_length=5)
#     country: Literal["NL"] = "NL"
# class Item(BaseModel):
#     name: str
#     quantity: int = Field(ge=1, le=100)
#     price: float = Field(gt=0)
#     tags: list[str] = []
# class Cat(BaseModel): kind: Literal["cat"]; lives: int = Field(ge=0, le=9)
# class Dog(BaseModel): kind: Literal["dog"]; good: bool
# class Order(BaseModel):
#     id: UUID
#     created: datetime
#     items: list[Item] = Field(min_length=1, max_length=5)
#     shipping: Address | None = None
#     billing: Address = Field(description="where the invoice goes")
#     color: Color
#     speed: Literal["standard", "express"]
#     counts: dict[str, int]
#     pair: tuple[int, str]
#     flags: set[int]
#     total: Decimal
#     pet: Cat | Dog = Field(discriminator="kind")
#     note: str | None = None
ORDER: dict[str, Any] = {
    "$defs": {
        "Address": {
            "properties": {
                "street": {"title": "Street", "type": "string"},
                "zip": {"maxLength": 5, "minLength": 5, "title": "Zip", "type": "string"},
                "country": {"const": "NL", "default": "NL", "title": "Country", "type": "string"},
            },
            "required": ["street", "zip"],
            "title": "Address",
            "type": "object",
        },
        "Cat": {
            "properties": {
                "kind": {"const": "cat", "title": "Kind", "type": "string"},
                "lives": {"maximum": 9, "minimum": 0, "title": "Lives", "type": "integer"},
            },
            "required": ["kind", "lives"],
            "title": "Cat",
            "type": "object",
        },
        "Color": {"enum": ["red", "green", "blue"], "title": "Color", "type": "string"},
        "Dog": {
            "properties": {
                "kind": {"const": "dog", "title": "Kind", "type": "string"},
                "good": {"title": "Good", "type": "boolean"},
            },
            "required": ["kind", "good"],
            "title": "Dog",
            "type": "object",
        },
        "Item": {
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "quantity": {"maximum": 100, "minimum": 1, "title": "Quantity", "type": "integer"},
                "price": {"exclusiveMinimum": 0, "title": "Price", "type": "number"},
                "tags": {"default": [], "items": {"type": "string"}, "title": "Tags", "type": "array"},
            },
            "required": ["name", "quantity", "price"],
            "title": "Item",
            "type": "object",
        },
    },
    "properties": {
        "id": {"format": "uuid", "title": "Id", "type": "string"},
        "created": {"format": "date-time", "title": "Created", "type": "string"},
        "items": {
            "items": {"$ref": "#/$defs/Item"},
            "maxItems": 5,
            "minItems": 1,
            "title": "Items",
            "type": "array",
        },
        "shipping": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "billing": {"$ref": "#/$defs/Address", "description": "where the invoice goes"},
        "color": {"$ref": "#/$defs/Color"},
        "speed": {"enum": ["standard", "express"], "title": "Speed", "type": "string"},
        "counts": {"additionalProperties": {"type": "integer"}, "title": "Counts", "type": "object"},
        "pair": {
            "maxItems": 2,
            "minItems": 2,
            "prefixItems": [{"type": "integer"}, {"type": "string"}],
            "title": "Pair",
            "type": "array",
        },
        "flags": {"items": {"type": "integer"}, "title": "Flags", "type": "array", "uniqueItems": True},
        "total": {
            "anyOf": [{"type": "number"}, {"pattern": "^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$", "type": "string"}],
            "title": "Total",
        },
        "pet": {
            "discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}, "propertyName": "kind"},
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "title": "Pet",
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
    },
    "required": ["id", "created", "items", "billing", "color", "speed", "counts", "pair", "flags", "total", "pet"],
    "title": "Order",
    "type": "object",
}

# class Node(BaseModel):
#     value: int
#     children: list["Node"] = []
#     parent: Optional["Node"] = None
# A model that refers to itself is written as a $ref to its own $defs entry.
NODE: dict[str, Any] = {
    "$defs": {
        "Node": {
            "properties": {
                "value": {"title": "Value", "type": "integer"},
                "children": {"default": [], "items": {"$ref": "#/$defs/Node"}, "title": "Children", "type": "array"},
                "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}], "default": None},
            },
            "required": ["value"],
            "title": "Node",
            "type": "object",
        }
    },
    "$ref": "#/$defs/Node",
}

# The openai SDK's strict form (`to_strict_json_schema`) of
# class Step(BaseModel): explanation: str; output: str
# class Math(BaseModel): steps: list[Step]; final_answer: str; confidence: float | None = None
# every object closed, every property required, the None default dropped.
MATH_STRICT: dict[str, Any] = {
    "$defs": {
        "Step": {
            "properties": {
                "explanation": {"title": "Explanation", "type": "string"},
                "output": {"title": "Output", "type": "string"},
            },
            "required": ["explanation", "output"],
            "title": "Step",
            "type": "object",
            "additionalProperties": False,
        }
    },
    "properties": {
        "steps": {"items": {"$ref": "#/$defs/Step"}, "title": "Steps", "type": "array"},
        "final_answer": {"title": "Final Answer", "type": "string"},
        "confidence": {"anyOf": [{"type": "number"}, {"type": "null"}], "title": "Confidence"},
    },
    "required": ["steps", "final_answer", "confidence"],
    "title": "Math",
    "type": "object",
    "additionalProperties": False,
}

# LangChain's `convert_to_openai_tool` of
# def multiply(a: int, b: int) -> int: """Multiply two integers."""
MULTIPLY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "type": "object",
        },
    },
}

# The openai SDK's `pydantic_function_tool(GetWeather)` of
# class GetWeather(BaseModel):
#     city: str
#     unit: Literal["c", "f"] = "c"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "GetWeather",
        "strict": True,
        "parameters": {
            "properties": {
                "city": {"title": "City", "type": "string"},
                "unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"},
            },
            "required": ["city", "unit"],
            "title": "GetWeather",
            "type": "object",
            "additionalProperties": False,
        },
    },
}
