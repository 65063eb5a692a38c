defmodule EMLXAxon.ToolCalls do
  @moduledoc """
  Tool calls in Qwen's format: the model answers a prompt rendered with
  `tools:` (see `EMLXAxon.Tokenizer.apply_chat_template/3`) with blocks such as

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  `parse/1` reads them; `grammar/1` builds the Lark grammar that makes a
  model answer with exactly such calls, each one's arguments valid against
  its tool's JSON Schema (the `:grammar` option of
  `EMLXAxon.TextGeneration.run/4`).
  """

  alias EMLXAxon.JSON.Decoder

  @type call :: %{name: String.t(), arguments: map()}

  @open "<tool_call>"
  @close "</tool_call>"

  @doc """
  The tool calls in `text`: `{:ok, calls, errors}` where `calls` are the
  well-formed blocks, in order, and `errors` describe the malformed ones
  (not JSON, no string `"name"`, `"arguments"` not an object, or a block
  never closed). Arguments given as a JSON string are decoded.

  ## Examples

      iex> EMLXAxon.ToolCalls.parse(~s(<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>))
      {:ok, [%{name: "f", arguments: %{"x" => 1}}], []}

  """
  @spec parse(String.t()) :: {:ok, [call()], [String.t()]}
  def parse(text) when is_binary(text) do
    {calls, errors} =
      text
      |> blocks([])
      |> Enum.reduce({[], []}, fn
        {:ok, body}, {calls, errors} ->
          case call(body) do
            {:ok, call} -> {[call | calls], errors}
            {:error, error} -> {calls, [error | errors]}
          end

        {:error, error}, {calls, errors} ->
          {calls, [error | errors]}
      end)

    {:ok, Enum.reverse(calls), Enum.reverse(errors)}
  end

  defp blocks(text, acc) do
    case :binary.split(text, @open) do
      [_no_block] ->
        Enum.reverse(acc)

      [_before, rest] ->
        case :binary.split(rest, @close) do
          [body, rest] -> blocks(rest, [{:ok, body} | acc])
          [_unclosed] -> Enum.reverse([{:error, "a #{@open} block is never closed"} | acc])
        end
    end
  end

  defp call(body) do
    with {:ok, json} <- decode(body),
         {:ok, name} <- name(json),
         {:ok, arguments} <- arguments(json) do
      {:ok, %{name: name, arguments: arguments}}
    end
  end

  defp decode(body) do
    case Decoder.decode(body) do
      {:ok, json} -> {:ok, json}
      {:error, reason} -> {:error, "a tool call is not valid JSON (#{reason}): #{inspect(body)}"}
    end
  end

  defp name(%{"name" => name}) when is_binary(name) and name != "", do: {:ok, name}
  defp name(json), do: {:error, "a tool call has no \"name\" string: #{inspect(json)}"}

  defp arguments(%{"arguments" => arguments}) when is_map(arguments), do: {:ok, arguments}
  defp arguments(json) when not is_map_key(json, "arguments"), do: {:ok, %{}}

  defp arguments(%{"arguments" => text} = json) when is_binary(text) do
    case Decoder.decode(text) do
      {:ok, arguments} when is_map(arguments) -> {:ok, arguments}
      _ -> {:error, "a tool call's \"arguments\" are not a JSON object: #{inspect(json)}"}
    end
  end

  defp arguments(json),
    do: {:error, "a tool call's \"arguments\" are not a JSON object: #{inspect(json)}"}

  @doc """
  Checks one tool definition, as the chat template and `grammar/1` take
  it: a map `%{type: "function", function: function}` or the inner
  `function` map itself, where `function` has a non-empty string `name`,
  and optionally a string `description` and a JSON Schema map
  `parameters` (keys may be atoms or strings). Returns `:ok` or
  `{:error, reason}`.

  ## Examples

      iex> EMLXAxon.ToolCalls.check_tool(%{type: "function", function: %{name: "f"}})
      :ok
      iex> {:error, reason} = EMLXAxon.ToolCalls.check_tool(%{"bad" => 1})
      iex> reason =~ "non-empty string name"
      true

  """
  @spec check_tool(term()) :: :ok | {:error, String.t()}
  def check_tool(tool) when is_map(tool) and not is_struct(tool) do
    function = field(tool, :function) || tool
    type = field(tool, :type)

    cond do
      type not in [nil, "function", :function] ->
        {:error, "a tool's type must be \"function\", got: #{inspect(tool)}"}

      not is_map(function) or is_struct(function) ->
        {:error, "a tool's function must be a map, got: #{inspect(tool)}"}

      not (is_binary(name = field(function, :name)) and name != "") ->
        {:error, "a tool needs a non-empty string name, got: #{inspect(tool)}"}

      not (is_nil(field(function, :description)) or is_binary(field(function, :description))) ->
        {:error, "a tool's description must be a string, got: #{inspect(tool)}"}

      not (is_nil(field(function, :parameters)) or schema?(field(function, :parameters))) ->
        {:error, "a tool's parameters must be a JSON Schema map, got: #{inspect(tool)}"}

      true ->
        :ok
    end
  end

  def check_tool(other), do: {:error, "a tool must be a map, got: #{inspect(other)}"}

  defp schema?(schema), do: is_map(schema) and not is_struct(schema)

  @doc """
  A Lark grammar (for the `:grammar` option) whose sentences are one or
  more Qwen tool calls to the given `tools` (as given to the chat template:
  `%{type: "function", function: %{name: ..., parameters: schema}}` or the
  inner function maps), each call's `"arguments"` valid against its tool's
  `parameters` schema.

  ## Options

    * `:max_calls` - the most calls in one answer (default `:infinity`);
      with 1, the output is complete once the first call is closed
  """
  @spec grammar([map()], keyword()) :: String.t()
  def grammar(tools, opts \\ [])

  def grammar([_ | _] = tools, opts) do
    more =
      case Keyword.get(opts, :max_calls, :infinity) do
        :infinity ->
          ~s[ ("\\n" call)*]

        n when is_integer(n) and n > 0 ->
          String.duplicate(~s[ ("\\n" call)?], n - 1)

        other ->
          raise ArgumentError,
                "expected :max_calls to be a positive integer or :infinity, got: #{inspect(other)}"
      end

    schemas =
      Enum.map(tools, fn tool ->
        with {:error, reason} <- check_tool(tool) do
          raise ArgumentError, "expected each tool to be a tool definition: #{reason}"
        end

        function = field(tool, :function) || tool
        name = field(function, :name)

        # Written by hand: "name" must come before "arguments", and an
        # Elixir map would order its keys.
        ~s({"type": "object", "properties": {"name": {"const": ) <>
          EMLXAxon.JSON.encode!(name) <>
          ~s(}, "arguments": ) <>
          EMLXAxon.JSON.encode!(field(function, :parameters) || %{type: "object"}) <>
          ~s(}, "required": ["name", "arguments"], "additionalProperties": false})
      end)

    # Arguments written as the chat template writes them, without optional
    # whitespace a model could pad the call with.
    schema =
      ~s({"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", ) <>
        ~s("key_separator": ": "}, "anyOf": [) <> Enum.join(schemas, ", ") <> "]}"

    """
    start: call#{more}
    call: "#{@open}\\n" body "\\n#{@close}"
    body: %json #{schema}
    """
  end

  def grammar(other, _opts),
    do: raise(ArgumentError, "expected a non-empty list of tools, got: #{inspect(other)}")

  defp field(map, key) when is_map(map), do: Map.get(map, key) || Map.get(map, to_string(key))
  defp field(_other, _key), do: nil
end
