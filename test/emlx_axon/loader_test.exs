defmodule EMLXAxon.Qwen3.LoaderTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, TestFixtures}
  alias EMLXAxon.Qwen3.{Loader, Model, Model.State}

  @moduletag :fixtures

  describe "load/2" do
    for name <- TestFixtures.models() do
      test "loads #{name}" do
        name = unquote(name)
        path = TestFixtures.path(name)
        assert {:ok, %State{ref: ref, path: ^path, config: config} = state} = Loader.load(path)
        assert is_reference(ref)

        assert %{
                 model_type: model_type,
                 num_layers: 2,
                 hidden_size: 128,
                 vocab_size: 151_936,
                 num_heads: 4,
                 num_kv_heads: 2,
                 eos_token_ids: eos,
                 dtype: dtype,
                 quantization: quantization,
                 load_ms: load_ms,
                 weight_bytes: weight_bytes,
                 path: ^path
               } = config

        assert model_type == if(String.starts_with?(name, "qwen2"), do: "qwen2", else: "qwen3")
        assert is_list(eos) and eos != []
        assert is_binary(dtype)
        assert is_float(load_ms) and load_ms >= 0
        assert is_integer(weight_bytes) and weight_bytes > 0

        case name do
          "qwen3-bf16" -> assert quantization == nil
          "qwen3-4bit-g128" -> assert %{bits: 4, group_size: 128} = quantization
          "qwen3-4bit-g64" -> assert %{bits: 4, group_size: 64} = quantization
          _ -> assert %{bits: _, group_size: _} = quantization
        end

        assert {:ok, ^config} = Model.info(state)
        assert inspect(state) =~ "#EMLXAxon.Qwen3.Model.State<#{model_type} 2 layers"
      end
    end

    test "accepts {:local, path} and relative paths" do
      path = TestFixtures.path("qwen3-4bit-g64")
      assert {:ok, %State{path: ^path}} = Loader.load({:local, path})
      assert {:ok, %State{path: ^path}} = Loader.load(Path.relative_to_cwd(path))
    end

    test "dtype option" do
      path = TestFixtures.path("qwen3-4bit-g64")

      for {dtype, name} <- [float32: "float32", bfloat16: "bfloat16", float16: "float16"] do
        assert {:ok, %State{config: %{dtype: ^name}}} = Loader.load(path, dtype: dtype)
      end
    end

    test "quantize option quantizes a dense checkpoint while loading" do
      path = TestFixtures.path("qwen3-bf16")

      assert {:ok, %State{config: %{quantization: %{bits: 4, group_size: 128}}}} =
               Loader.load(path, quantize: [bits: 4, group_size: 128])

      assert {:ok, %State{config: %{quantization: %{bits: 8, group_size: 64}}}} =
               Loader.load(path, quantize: [bits: 8])
    end

    test "load!/2" do
      assert %State{} = Loader.load!(TestFixtures.path("qwen3-4bit-g64"))
      assert_raise Error, ~r/does not exist/, fn -> Loader.load!("/no/such/model") end
    end
  end

  describe "errors" do
    test "quantizing an already quantized checkpoint" do
      assert {:error, %Error{kind: :invalid_argument, message: message}} =
               Loader.load(TestFixtures.path("qwen3-4bit-g64"), quantize: [bits: 4])

      assert message =~ "already quantized"
    end

    test "missing directory" do
      assert {:error, %Error{kind: :io, message: message}} = Loader.load("/no/such/model")
      assert message =~ "/no/such/model"
    end

    test "directory without config.json" do
      dir = tmp_dir()
      assert {:error, %Error{kind: :io, message: message}} = Loader.load(dir)
      assert message =~ "config.json"
    end

    test "malformed config.json" do
      dir = tmp_dir()
      File.write!(Path.join(dir, "config.json"), "{ nope")
      assert {:error, %Error{kind: :json}} = Loader.load(dir)
    end

    test "config without weights" do
      dir = tmp_dir()

      File.cp!(
        Path.join(TestFixtures.path("qwen3-bf16"), "config.json"),
        Path.join(dir, "config.json")
      )

      assert {:error, %Error{kind: kind}} = Loader.load(dir)
      assert kind in [:io, :safetensors, :missing_tensor]
    end

    test "unsupported model type" do
      dir = tmp_dir()

      config =
        TestFixtures.path("qwen3-bf16")
        |> Path.join("config.json")
        |> File.read!()
        |> String.replace(~s("model_type": "qwen3"), ~s("model_type": "llama"))

      File.write!(Path.join(dir, "config.json"), config)

      File.cp!(
        Path.join(TestFixtures.path("qwen3-bf16"), "model.safetensors"),
        Path.join(dir, "model.safetensors")
      )

      assert {:error, %Error{kind: kind}} = Loader.load(dir)
      assert kind in [:unsupported, :config]
    end

    test "truncated weights" do
      dir = tmp_dir()
      source = TestFixtures.path("qwen3-bf16")
      File.cp!(Path.join(source, "config.json"), Path.join(dir, "config.json"))
      weights = File.read!(Path.join(source, "model.safetensors"))

      File.write!(
        Path.join(dir, "model.safetensors"),
        binary_part(weights, 0, div(byte_size(weights), 2))
      )

      assert {:error, %Error{kind: :safetensors}} = Loader.load(dir)
    end

    test "tensors the model does not use are refused unless strict: false" do
      source = TestFixtures.path("qwen3-bf16")
      dir = tmp_dir()
      File.cp!(Path.join(source, "config.json"), Path.join(dir, "config.json"))
      File.cp!(Path.join(source, "model.safetensors"), Path.join(dir, "model.safetensors"))
      File.write!(Path.join(dir, "model-extra.safetensors"), safetensors("model.extra.weight"))

      assert {:error, %Error{kind: :unexpected_tensor, message: message}} = Loader.load(dir)
      assert message =~ "model.extra.weight"
      assert message =~ "strict: false"
      assert {:ok, %State{}} = Loader.load(dir, strict: false)
    end

    test "bad options raise ArgumentError" do
      path = TestFixtures.path("qwen3-4bit-g64")

      assert_raise ArgumentError,
                   ~r/unknown option :bits.*valid options are: :dtype, :quantize/,
                   fn ->
                     Loader.load(path, bits: 4)
                   end

      assert_raise ArgumentError, ~r/:dtype to be one of/, fn ->
        Loader.load(path, dtype: :f64)
      end

      # The engine's own list: 7 is in 2..8 but no MLX kernel packs it.
      for bits <- [7, 9, 1, 4.0] do
        assert_raise ArgumentError, ~r/:bits to be one of \[2, 3, 4, 5, 6, 8\]/, fn ->
          Loader.load(path, quantize: [bits: bits])
        end
      end

      assert_raise ArgumentError, ~r/:strict to be a boolean/, fn ->
        Loader.load(path, strict: :no)
      end

      assert_raise ArgumentError, ~r/:group_size to be one of \[32, 64, 128\]/, fn ->
        Loader.load(path, quantize: [bits: 4, group_size: 16])
      end

      assert_raise ArgumentError, ~r/:quantize to be nil or a keyword list/, fn ->
        Loader.load(path, quantize: 4)
      end

      assert_raise ArgumentError, ~r/keyword list/, fn -> Loader.load(path, :nope) end
      assert_raise ArgumentError, ~r/checkpoint directory path/, fn -> Loader.load(42) end
    end
  end

  # A safetensors file holding one float32 tensor of two zeros.
  defp safetensors(name) do
    header = ~s({"#{name}":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})
    header = header <> String.duplicate(" ", rem(8 - rem(byte_size(header), 8), 8))
    <<byte_size(header)::little-64, header::binary, 0::64>>
  end

  defp tmp_dir do
    dir = Path.join(System.tmp_dir!(), "emlx_axon_loader_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    dir
  end
end
