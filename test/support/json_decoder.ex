defmodule EMLXAxon.TestJSON do
  @moduledoc false
  # A minimal strict JSON decoder, only to check EMLXAxon.JSON's output and
  # the mix task's --json output in tests. Objects decode to maps with
  # string keys.

  def decode!(binary) do
    {value, rest} = value(skip_ws(binary))

    case skip_ws(rest) do
      "" -> value
      other -> raise ArgumentError, "trailing data: #{inspect(other)}"
    end
  end

  defp value("null" <> rest), do: {nil, rest}
  defp value("true" <> rest), do: {true, rest}
  defp value("false" <> rest), do: {false, rest}
  defp value("\"" <> rest), do: string(rest, [])
  defp value("[" <> rest), do: array(skip_ws(rest), [])
  defp value("{" <> rest), do: object(skip_ws(rest), %{})
  defp value(<<c, _::binary>> = binary) when c in ?0..?9 or c == ?-, do: number(binary)
  defp value(other), do: raise(ArgumentError, "unexpected: #{inspect(other)}")

  defp array("]" <> rest, []), do: {[], rest}

  defp array(binary, acc) do
    {value, rest} = value(skip_ws(binary))

    case skip_ws(rest) do
      "," <> rest -> array(skip_ws(rest), [value | acc])
      "]" <> rest -> {Enum.reverse([value | acc]), rest}
      other -> raise ArgumentError, "bad array at #{inspect(other)}"
    end
  end

  defp object("}" <> rest, acc) when acc == %{}, do: {acc, rest}

  defp object("\"" <> rest, acc) do
    {key, rest} = string(rest, [])
    ":" <> rest = skip_ws(rest)
    {value, rest} = value(skip_ws(rest))
    acc = Map.put(acc, key, value)

    case skip_ws(rest) do
      "," <> rest -> object(skip_ws(rest), acc)
      "}" <> rest -> {acc, rest}
      other -> raise ArgumentError, "bad object at #{inspect(other)}"
    end
  end

  defp string("\"" <> rest, acc), do: {acc |> Enum.reverse() |> IO.iodata_to_binary(), rest}
  defp string("\\\"" <> rest, acc), do: string(rest, ["\"" | acc])
  defp string("\\\\" <> rest, acc), do: string(rest, ["\\" | acc])
  defp string("\\/" <> rest, acc), do: string(rest, ["/" | acc])
  defp string("\\n" <> rest, acc), do: string(rest, ["\n" | acc])
  defp string("\\r" <> rest, acc), do: string(rest, ["\r" | acc])
  defp string("\\t" <> rest, acc), do: string(rest, ["\t" | acc])
  defp string("\\b" <> rest, acc), do: string(rest, ["\b" | acc])
  defp string("\\f" <> rest, acc), do: string(rest, ["\f" | acc])

  defp string("\\u" <> <<hex::binary-4, rest::binary>>, acc) do
    code = String.to_integer(hex, 16)

    case {code, rest} do
      {high, "\\u" <> <<low_hex::binary-4, rest2::binary>>} when high in 0xD800..0xDBFF ->
        low = String.to_integer(low_hex, 16)
        cp = 0x10000 + (high - 0xD800) * 0x400 + (low - 0xDC00)
        string(rest2, [<<cp::utf8>> | acc])

      _ ->
        string(rest, [<<code::utf8>> | acc])
    end
  end

  defp string(<<c, _::binary>>, _acc) when c < 0x20,
    do: raise(ArgumentError, "unescaped control character #{c}")

  defp string(<<c::utf8, rest::binary>>, acc), do: string(rest, [<<c::utf8>> | acc])

  defp number(binary) do
    {match, rest} =
      case Regex.run(~r/^-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/, binary) do
        [match | _] ->
          {match, binary_part(binary, byte_size(match), byte_size(binary) - byte_size(match))}

        nil ->
          raise ArgumentError, "bad number at #{inspect(binary)}"
      end

    if String.contains?(match, [".", "e", "E"]) do
      {match |> normalize_float() |> String.to_float(), rest}
    else
      {String.to_integer(match), rest}
    end
  end

  # String.to_float/1 needs a fraction before an exponent ("1e5" -> "1.0e5").
  defp normalize_float(text) do
    if String.contains?(text, ".") do
      text
    else
      String.replace(text, ~r/[eE]/, ".0e")
    end
  end

  defp skip_ws(<<c, rest::binary>>) when c in [?\s, ?\n, ?\r, ?\t], do: skip_ws(rest)
  defp skip_ws(binary), do: binary
end
