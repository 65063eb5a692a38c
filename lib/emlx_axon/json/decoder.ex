defmodule EMLXAxon.JSON.Decoder do
  @moduledoc """
  A small strict JSON decoder (RFC 8259), for reading the JSON a model
  writes, such as tool-call arguments. Objects decode to maps with string
  keys (a repeated key keeps its last value), arrays to lists, numbers to
  integers or floats, `null` to `nil`.
  """

  @doc """
  Decodes `text`: `{:ok, term}` or `{:error, reason}` with a message that
  says what was expected and where.

  ## Examples

      iex> EMLXAxon.JSON.Decoder.decode(~s({"a": [1, 2.5, "x\\\\u00e9"], "b": null}))
      {:ok, %{"a" => [1, 2.5, "xé"], "b" => nil}}

      iex> EMLXAxon.JSON.Decoder.decode("[1,")
      {:error, "expected a JSON value at byte 3"}

  """
  @spec decode(binary()) :: {:ok, term()} | {:error, String.t()}
  def decode(text) when is_binary(text) do
    {value, rest} = value(skip(text), text)

    case skip(rest) do
      "" -> {:ok, value}
      rest -> fail("the end of the text", rest, text)
    end
  catch
    {:json_error, message} -> {:error, message}
  end

  defp value(<<"{", rest::binary>>, all), do: object(skip(rest), all, %{})
  defp value(<<"[", rest::binary>>, all), do: array(skip(rest), all, [])
  defp value(<<"\"", rest::binary>>, all), do: string(rest, all, [])
  defp value(<<"true", rest::binary>>, _all), do: {true, rest}
  defp value(<<"false", rest::binary>>, _all), do: {false, rest}
  defp value(<<"null", rest::binary>>, _all), do: {nil, rest}
  defp value(<<c, _::binary>> = text, all) when c == ?- or c in ?0..?9, do: number(text, all)
  defp value(rest, all), do: fail("a JSON value", rest, all)

  defp object(<<"}", rest::binary>>, _all, acc), do: {acc, rest}
  defp object(rest, all, acc), do: member(rest, all, acc)

  defp member(<<"\"", rest::binary>>, all, acc) do
    {key, rest} = string(rest, all, [])

    case skip(rest) do
      <<":", rest::binary>> ->
        {value, rest} = value(skip(rest), all)
        acc = Map.put(acc, key, value)

        case skip(rest) do
          <<",", rest::binary>> -> member(skip(rest), all, acc)
          <<"}", rest::binary>> -> {acc, rest}
          rest -> fail("',' or '}'", rest, all)
        end

      rest ->
        fail("':'", rest, all)
    end
  end

  defp member(rest, all, _acc), do: fail("an object key", rest, all)

  defp array(<<"]", rest::binary>>, _all, acc), do: {Enum.reverse(acc), rest}

  defp array(rest, all, acc) do
    {value, rest} = value(rest, all)

    case skip(rest) do
      <<",", rest::binary>> -> array_next(skip(rest), all, [value | acc])
      <<"]", rest::binary>> -> {Enum.reverse([value | acc]), rest}
      rest -> fail("',' or ']'", rest, all)
    end
  end

  # After a comma a value must follow (no trailing comma).
  defp array_next(<<"]", _::binary>> = rest, all, _acc), do: fail("a JSON value", rest, all)
  defp array_next(rest, all, acc), do: array(rest, all, acc)

  defp string(<<"\"", rest::binary>>, _all, acc),
    do: {IO.iodata_to_binary(Enum.reverse(acc)), rest}

  defp string(<<"\\", c, rest::binary>>, all, acc) when c in ~c(\"\\/bfnrt) do
    char =
      case c do
        ?b -> ?\b
        ?f -> ?\f
        ?n -> ?\n
        ?r -> ?\r
        ?t -> ?\t
        other -> other
      end

    string(rest, all, [char | acc])
  end

  defp string(<<"\\u", hex::binary-4, rest::binary>> = text, all, acc) do
    case {hex_value(hex), rest} do
      {high, <<"\\u", low_hex::binary-4, after_low::binary>>} when high in 0xD800..0xDBFF ->
        case hex_value(low_hex) do
          low when low in 0xDC00..0xDFFF ->
            code = 0x10000 + (high - 0xD800) * 0x400 + (low - 0xDC00)
            string(after_low, all, [<<code::utf8>> | acc])

          _ ->
            fail("a low surrogate escape", rest, all)
        end

      {code, _} when code in 0xD800..0xDFFF ->
        fail("a valid \\u escape", text, all)

      {code, _} when is_integer(code) ->
        string(rest, all, [<<code::utf8>> | acc])

      {nil, _} ->
        fail("four hex digits", text, all)
    end
  end

  defp string(<<c, _::binary>> = rest, all, _acc) when c < 0x20 or c == ?\\,
    do: fail("an escaped character", rest, all)

  defp string(<<c::utf8, rest::binary>>, all, acc), do: string(rest, all, [<<c::utf8>> | acc])
  defp string(rest, all, _acc), do: fail("a closing '\"'", rest, all)

  defp hex_value(hex) do
    case Integer.parse(hex, 16) do
      {value, ""} -> value
      _ -> nil
    end
  end

  @number ~r/\A-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/

  defp number(text, all) do
    case Regex.run(@number, text, capture: :all) do
      [match | parts] ->
        rest = binary_part(text, byte_size(match), byte_size(text) - byte_size(match))

        value =
          if Enum.any?(parts, &(&1 != "")) do
            float!(float_text(match), text, all)
          else
            String.to_integer(match)
          end

        {value, rest}

      nil ->
        fail("a number", text, all)
    end
  end

  defp float!(text, rest, all) do
    case Float.parse(text) do
      {float, ""} -> float
      _ -> fail("a number a float can hold", rest, all)
    end
  rescue
    ArgumentError -> fail("a number a float can hold", rest, all)
  end

  # Float.parse needs a fraction before an exponent ("1e5" -> "1.0e5").
  defp float_text(text) do
    if String.contains?(text, "."),
      do: text,
      else: String.replace(text, ~r/[eE]/, ".0e", global: false)
  end

  defp skip(<<c, rest::binary>>) when c in [?\s, ?\t, ?\n, ?\r], do: skip(rest)
  defp skip(rest), do: rest

  defp fail(expected, rest, all) do
    throw({:json_error, "expected #{expected} at byte #{byte_size(all) - byte_size(rest)}"})
  end
end
