"""JSON schemas of varied shape for the structured-output tests: nested objects, bounded arrays,
enums, numbers with ranges, required and optional fields, ``$ref``. Strings and arrays are
bounded so that a small model's output ends within a few dozen tokens."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "color_enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {
                    "city": NAME,
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "int_array": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["scores"],
    },
    "object_array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "tag": NAME},
            "required": ["id", "tag"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": NAME,
            "done": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["title", "done"],
    },
    "ref_points": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "ref_definitions": {
        "definitions": {"level": {"type": "string", "enum": ["low", "mid", "high"]}},
        "type": "object",
        "properties": {"risk": {"$ref": "#/definitions/level"}},
        "required": ["risk"],
    },
    "float_range": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ratio"],
    },
    "const_and_enum": {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
        },
        "required": ["kind", "day"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "maxLength": 6},
                ]
            }
        },
        "required": ["value"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["nickname"],
    },
    "prefix_items": {
        "type": "array",
        "prefixItems": [
            NAME,
            {"type": "integer", "minimum": 0, "maximum": 99},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
        "required": ["n"],
    },
    "no_additional": {
        "type": "object",
        "properties": {"city": NAME, "country": NAME},
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["rows"],
    },
    "number_enum": {
        "type": "object",
        "properties": {"size": {"enum": [1, 2, 4, 8]}, "unit": {"enum": ["kb", "mb"]}},
        "required": ["size", "unit"],
    },
    "one_of_disjoint": {
        "type": "object",
        "properties": {
            "id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]}
        },
        "required": ["id"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["word"],
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "count": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["tags"],
    },
}
