defmodule EMLXAxon.NativeTest do
  use ExUnit.Case, async: true

  doctest EMLXAxon
  doctest EMLXAxon.Error

  alias EMLXAxon.{Native, TestFixtures}

  test "the NIF is loaded" do
    assert Native.load_error() == nil
  end

  test "mlx_info/0" do
    assert %{mlx_version: version, default_device: device, gpu_available: gpu?} =
             EMLXAxon.mlx_info()

    assert version =~ ~r/^\d+\.\d+/
    assert device in [:cpu, :gpu]
    assert is_boolean(gpu?)
  end

  describe "native generations" do
    @describetag :fixtures

    setup do
      state = TestFixtures.model("qwen3-4bit-g64")
      %{"prompt_ids" => ids} = TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]
      %{state: state, ids: ids}
    end

    defp opts(extra), do: TestFixtures.native_opts(Map.merge(%{max_new_tokens: 4}, extra))

    test "next after :done returns :done with empty rows", %{state: state, ids: ids} do
      {:ok, gen} = Native.generation_start(state.ref, nil, nil, [ids], opts(%{}))

      assert {:ok, {:done, [%{ids: [_, _, _, _], finish_reason: :length, text: ""}]}} =
               Native.generation_next(gen, 10)

      assert {:ok, {:done, [%{ids: []}]}} = Native.generation_next(gen, 10)
      assert {:ok, %{prompt_tokens: [10], generated_tokens: [4]}} = Native.generation_stats(gen)
    end

    test "use after free is a :released error", %{state: state, ids: ids} do
      {:ok, gen} = Native.generation_start(state.ref, nil, nil, [ids], opts(%{}))
      assert :ok = Native.generation_free(gen)
      assert :ok = Native.generation_free(gen)
      assert {:error, {:released, message}} = Native.generation_next(gen, 1)
      assert is_binary(message)
      assert {:error, {:released, _}} = Native.generation_stats(gen)
    end

    test "bad argument types are ArgumentErrors", %{state: state, ids: ids} do
      assert_raise ArgumentError, fn ->
        Native.generation_start(state.ref, nil, nil, [ids], %{})
      end

      assert_raise ArgumentError, fn ->
        Native.generation_start(:model, nil, nil, [ids], opts(%{}))
      end

      assert_raise ArgumentError, fn ->
        Native.generation_start(state.ref, nil, nil, [["x"]], opts(%{}))
      end
    end

    test "an unknown sampler atom is an :invalid_argument error", %{state: state, ids: ids} do
      assert {:error, {:invalid_argument, _}} =
               Native.generation_start(state.ref, nil, nil, [ids], opts(%{sampler: :other}))
    end
  end
end
