defmodule EMLXAxon.TestSchema do
  @moduledoc false
  # The JSON Schema subset the structured-output tests use (enum, object,
  # array, string and number bounds), checked independently of the engine.

  @doc "Whether `value` (decoded JSON) follows `schema` (string keys)."
  def valid?(value, schema) do
    enum_ok = not Map.has_key?(schema, "enum") or value in schema["enum"]
    enum_ok and type_ok?(schema["type"], value, schema)
  end

  defp type_ok?(nil, _value, _schema), do: true

  defp type_ok?("object", value, schema) when is_map(value) do
    properties = schema["properties"] || %{}

    Enum.all?(schema["required"] || [], &Map.has_key?(value, &1)) and
      Enum.all?(value, fn {key, v} ->
        case properties do
          %{^key => s} -> valid?(v, s)
          _ -> schema["additionalProperties"] != false
        end
      end)
  end

  defp type_ok?("array", value, schema) when is_list(value) do
    n = length(value)

    n >= (schema["minItems"] || 0) and n <= (schema["maxItems"] || n) and
      Enum.all?(value, &valid?(&1, schema["items"] || %{}))
  end

  defp type_ok?("string", value, schema) when is_binary(value) do
    n = String.length(value)
    n >= (schema["minLength"] || 0) and n <= (schema["maxLength"] || n)
  end

  defp type_ok?("integer", value, schema) when is_integer(value), do: in_range?(value, schema)

  defp type_ok?("number", value, schema) when is_number(value), do: in_range?(value, schema)
  defp type_ok?("boolean", value, _schema), do: is_boolean(value)
  defp type_ok?("null", value, _schema), do: value == nil
  defp type_ok?(_type, _value, _schema), do: false

  defp in_range?(x, schema) do
    (schema["minimum"] == nil or x >= schema["minimum"]) and
      (schema["maximum"] == nil or x <= schema["maximum"]) and
      (schema["exclusiveMinimum"] == nil or x > schema["exclusiveMinimum"]) and
      (schema["exclusiveMaximum"] == nil or x < schema["exclusiveMaximum"])
  end
end
