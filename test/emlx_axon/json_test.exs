defmodule EMLXAxon.JSONTest do
  use ExUnit.Case, async: true

  doctest EMLXAxon.JSON

  alias EMLXAxon.{JSON, TestJSON}

  test "scalars" do
    assert JSON.encode!(nil) == "null"
    assert JSON.encode!(true) == "true"
    assert JSON.encode!(false) == "false"
    assert JSON.encode!(:eos) == ~s("eos")
    assert JSON.encode!(0) == "0"
    assert JSON.encode!(-12_345_678_901_234_567_890) == "-12345678901234567890"
    assert JSON.encode!(1.5) == "1.5"
    assert JSON.encode!(0.1) == "0.1"
    assert JSON.encode!(1.0e-7) |> TestJSON.decode!() == 1.0e-7
    assert JSON.encode!(123_456_789.0e20) |> TestJSON.decode!() == 123_456_789.0e20
  end

  test "strings" do
    for text <- [
          "",
          "plain",
          ~s(quote " and backslash \\),
          "newline\n tab\t return\r backspace\b formfeed\f",
          "nul \0 and \x01 and \x1f and del \x7f",
          "é 大型 🦊 \u2028 \u2029",
          "</script>"
        ] do
      json = JSON.encode!(text)
      assert TestJSON.decode!(json) == text, "round trip of #{inspect(text)}"
      refute json =~ ~r/[\x00-\x1f]/
    end

    assert JSON.encode!("\u2028") == ~s("\\u2028")
    assert JSON.encode!("\x01") == ~s("\\u0001")
    assert JSON.encode!("🦊") == ~s("🦊")
  end

  test "lists and maps" do
    term = %{
      "text" => "a\"b",
      ids: [1, 2, 3],
      nested: %{list: [nil, true, 1.25, "x", []], empty: %{}},
      finish_reason: :stop
    }

    assert TestJSON.decode!(JSON.encode!(term)) == %{
             "text" => "a\"b",
             "ids" => [1, 2, 3],
             "nested" => %{"list" => [nil, true, 1.25, "x", []], "empty" => %{}},
             "finish_reason" => "stop"
           }

    assert JSON.encode!(%{1 => 2}) == ~s({"1":2})
    assert JSON.encode!(%{b: 1, a: 2}) == ~s({"a":2,"b":1})
  end

  test "unencodable terms raise ArgumentError" do
    assert_raise ArgumentError, fn -> JSON.encode!({1, 2}) end
    assert_raise ArgumentError, fn -> JSON.encode!(self()) end
    assert_raise ArgumentError, fn -> JSON.encode!(<<0xFF>>) end
    assert_raise ArgumentError, fn -> JSON.encode!(%{{1} => 1}) end
    assert_raise ArgumentError, fn -> JSON.encode!(%{nil => 1}) end
    assert_raise ArgumentError, fn -> JSON.encode!(~D[2020-01-01]) end
  end
end
