defmodule EMLXAxon.JSON do
  @moduledoc """
  A small JSON encoder, for `mix emlx_axon.generate --json` and for tools
  that report results (Elixir 1.14 has no JSON module and this library
  has no dependencies).

  Encodes `nil`, booleans, numbers, strings, atoms (as strings), lists and
  maps (with atom, string or number keys). Strings must be valid UTF-8;
  they are written as UTF-8, with `"`, `\\`, control characters and the
  line/paragraph separators U+2028/U+2029 escaped.
  """

  @doc """
  Encodes `term` as a JSON string. Raises `ArgumentError` for terms JSON
  cannot represent (tuples, pids, non-finite floats, invalid UTF-8).

  ## Examples

      iex> EMLXAxon.JSON.encode!(%{text: "héllo \\"you\\"\\n", ids: [1, 2], ok: true, none: nil})
      ~s({"ids":[1,2],"none":null,"ok":true,"text":"héllo \\\\"you\\\\"\\\\n"})

      iex> EMLXAxon.JSON.encode!([1.5, -2, "tab\\t"])
      ~s([1.5,-2,"tab\\\\t"])

  """
  @spec encode!(term()) :: String.t()
  def encode!(term), do: term |> encode() |> IO.iodata_to_binary()

  defp encode(nil), do: "null"
  defp encode(true), do: "true"
  defp encode(false), do: "false"
  defp encode(atom) when is_atom(atom), do: string(Atom.to_string(atom))
  defp encode(binary) when is_binary(binary), do: string(binary)
  defp encode(integer) when is_integer(integer), do: Integer.to_string(integer)
  defp encode(float) when is_float(float), do: float_to_json(float)

  defp encode(list) when is_list(list) do
    ["[", list |> Enum.map(&encode/1) |> Enum.intersperse(","), "]"]
  end

  defp encode(%{__struct__: module} = struct) do
    raise ArgumentError, "cannot encode a #{inspect(module)} struct as JSON: #{inspect(struct)}"
  end

  defp encode(map) when is_map(map) do
    pairs =
      map
      |> Enum.map(fn {key, value} -> {key_to_string(key), value} end)
      |> Enum.sort_by(&elem(&1, 0))
      |> Enum.map(fn {key, value} -> [string(key), ":", encode(value)] end)
      |> Enum.intersperse(",")

    ["{", pairs, "}"]
  end

  defp encode(other) do
    raise ArgumentError, "cannot encode #{inspect(other)} as JSON"
  end

  defp key_to_string(key) when is_binary(key), do: key

  defp key_to_string(key) when is_atom(key) and key not in [nil, true, false],
    do: Atom.to_string(key)

  defp key_to_string(key) when is_integer(key), do: Integer.to_string(key)

  defp key_to_string(key) do
    raise ArgumentError, "cannot encode #{inspect(key)} as a JSON object key"
  end

  # Erlang's shortest round-trip representation is valid JSON as long as it
  # is not infinite or NaN (which cannot occur in BEAM floats).
  defp float_to_json(float), do: :erlang.float_to_binary(float, [:short])

  defp string(binary) do
    unless String.valid?(binary) do
      raise ArgumentError, "cannot encode invalid UTF-8 as a JSON string: #{inspect(binary)}"
    end

    [?", escape(binary, []), ?"]
  end

  defp escape(<<>>, acc), do: Enum.reverse(acc)
  defp escape(<<?", rest::binary>>, acc), do: escape(rest, ["\\\"" | acc])
  defp escape(<<?\\, rest::binary>>, acc), do: escape(rest, ["\\\\" | acc])
  defp escape(<<?\n, rest::binary>>, acc), do: escape(rest, ["\\n" | acc])
  defp escape(<<?\r, rest::binary>>, acc), do: escape(rest, ["\\r" | acc])
  defp escape(<<?\t, rest::binary>>, acc), do: escape(rest, ["\\t" | acc])
  defp escape(<<?\b, rest::binary>>, acc), do: escape(rest, ["\\b" | acc])
  defp escape(<<?\f, rest::binary>>, acc), do: escape(rest, ["\\f" | acc])

  defp escape(<<char, rest::binary>>, acc) when char < 0x20,
    do: escape(rest, [unicode_escape(char) | acc])

  defp escape(<<char::utf8, rest::binary>>, acc) when char in [0x2028, 0x2029],
    do: escape(rest, [unicode_escape(char) | acc])

  defp escape(<<char::utf8, rest::binary>>, acc), do: escape(rest, [<<char::utf8>> | acc])

  defp unicode_escape(char) do
    hex = char |> Integer.to_string(16) |> String.pad_leading(4, "0")
    ["\\u", hex]
  end
end
